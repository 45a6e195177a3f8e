"""OpenCL C sources of the opencl backend (installed as ``pagedkv.opencl``)."""

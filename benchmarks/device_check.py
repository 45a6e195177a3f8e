"""The GPU check in one call: pagedkv's OpenCL backend proven and measured on a device.

For machines that come rarely and briefly (a GPU for minutes, no network):
it installs what it needs from files brought along, then

1. lists the OpenCL platforms and devices with their limits (compute
   units, local memory, work-group sizes, extensions, fp16 support);
2. measures each checked device's own ceilings: memory bandwidth (a copy
   and a read kernel over a buffer many times its cache) and the rate of a
   tiled float32 matrix product (``device_check.cl``);
3. runs pagedkv's attention there (decode in float16, float32 and int8,
   prefill, windowed decode, latent decode) and a gated delta rule decode
   step (a hybrid model's recurrent layer, wall time, its state bytes read
   and written once), each figure a fraction of those ceilings, each result
   checked against a float64 reference (``tests/reference.py``);
4. where torch has CUDA, runs the same attention through torch on the GPU:
   SDPA over contiguous K/V with the kernel torch picks, and each SDPA
   backend (FlashAttention among them) that takes the inputs;
5. runs the OpenCL tests on each checked device (``PAGEDKV_TEST_DEVICES``);
6. writes ``report.md`` and ``report.json`` into OUT_DIR and prints the tables.

Checked devices: those ``--devices`` names (``;``-separated, as
``PAGEDKV_TEST_DEVICES`` takes them), else every GPU, else (no GPU) every
device but simulators; what needs a GPU or CUDA is then reported as
skipped, with the reason.  ``--quick`` shrinks every size and runs a few
tests (the test suite's smoke run).

Install (before pyopencl or pagedkv is imported): without pyopencl, the
wheels in ``--wheels`` (default ``.whl/``; see docs/gpu.md) go into
``--site`` with ``pip install --no-index``; without a built pagedkv (or
with ``--build``), pagedkv is built from this checkout with the machine's
own compiler, Cython and setuptools (``pip install --no-build-isolation``),
or the report says what is missing.  When the NVIDIA driver's
``libnvidia-opencl.so.1`` is there but no NVIDIA platform shows (a
container without its ICD file), an ICD file naming it is written to a
temporary folder that ``OCL_ICD_VENDORS`` then names.

    python3 benchmarks/device_check.py OUT_DIR [--quick] [--devices NAME] [--budget 420]
"""
import argparse
import datetime
import gc
import glob
import inspect
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")

#: The decode and prefill shape of every case (bench_attention.py's): GQA 4,
#: Llama-3-8B's heads, pages of 16.
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, PAGE_SIZE = 8, 32, 128, 16
#: pyproject.toml's build requirement: older setuptools rejects its license field.
MIN_SETUPTOOLS = (77,)
#: What an NVIDIA driver ships for OpenCL, and the platform name it shows.
NVIDIA_LIBRARY, NVIDIA_PLATFORM = "libnvidia-opencl.so.1", "NVIDIA"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
                "/usr/local/nvidia/lib", "/usr/lib/wsl/lib")


# -- sizes ------------------------------------------------------------------------------
class Sizes:
    """The cases' sizes for one device: large enough that K/V and the bandwidth
    buffer are many times the device's cache, small enough for the time limit
    (a CPU device computes on the cores that also fill the cache)."""

    def __init__(self, kind, quick):
        if quick:
            self.num_seqs, self.seq_len, self.prefill_len = 2, 256, 128
            self.window, self.window_seq_len, self.repeat = 64, 512, 2
            self.cache_multiple, self.max_buffer, self.sgemm_n = 4, 64 << 20, 128
        elif kind == "gpu":
            self.num_seqs, self.seq_len, self.prefill_len = 32, 4096, 4096
            self.window, self.window_seq_len, self.repeat = 512, 8192, 10
            self.cache_multiple, self.max_buffer, self.sgemm_n = 16, 2 << 30, 4096
        else:
            self.num_seqs, self.seq_len, self.prefill_len = 8, 2048, 1024
            self.window, self.window_seq_len, self.repeat = 256, 4096, 5
            # the tiled sgemm suits a GPU; on a CPU the host's BLAS sets the ceiling
            self.cache_multiple, self.max_buffer, self.sgemm_n = 16, 512 << 20, 512
        # whatever cache size the driver reports (some report a level-1 cache):
        # on a GPU at least 1 GiB, 16x an H200's 60 MB L2
        self.min_buffer = (1 << 30) if kind == "gpu" and not quick else 16 << 20

    def as_dict(self):
        return dict(vars(self))


# -- the clock and the report ---------------------------------------------------------
class Report:
    """What the check found, as it goes: ``data`` becomes report.json."""

    def __init__(self, budget):
        self.start = time.monotonic()
        self.budget = budget
        self.data = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "budget_s": budget, "install": [], "skipped": [],
            "devices": [], "checked": []}

    def elapsed(self):
        return time.monotonic() - self.start

    def left(self):
        return self.budget - self.elapsed()

    def skip(self, what, reason):
        self.data["skipped"].append({"what": what, "reason": reason})
        print(f"skipped: {what}: {reason}", flush=True)

    def step(self, what, ok, seconds, detail=""):
        self.data["install"].append({"step": what, "ok": ok, "seconds": round(seconds, 1),
                                     "detail": detail})
        print(f"{'ok' if ok else 'FAILED'}: {what} ({seconds:.1f} s){': ' + detail if detail else ''}",
              flush=True)


def _error(exc):
    """An exception as a line for the report, with where it happened."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}{at}"


def _run(cmd, *, env=None, cwd=None, timeout=None):
    """(return code, output, seconds) of a command; 124 when it ran past ``timeout``,
    and then its whole process group is killed (pytest-xdist's workers too)."""
    t0 = time.monotonic()
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return 124, out, time.monotonic() - t0


def _probe(code, env=None):
    """Run ``code`` in a fresh interpreter outside the checkout (whose ``pagedkv/``
    folder would shadow an installed pagedkv); its last output line as JSON, or
    an ``{"error": ...}``."""
    rc, out, _ = _run([sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(),
                      timeout=120)
    lines = out.strip().splitlines()
    if rc == 0 and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    return {"error": "\n".join(lines[-5:]) or f"exit status {rc}"}


def _add_site(site):
    """Make packages installed into ``site`` importable here and in every child."""
    import importlib
    if site not in sys.path:
        sys.path.insert(0, site)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([site] + [p for p in paths if p])
    importlib.invalidate_caches()


# -- install ----------------------------------------------------------------------------
_PYOPENCL_PROBE = "import json, pyopencl; print(json.dumps({'version': pyopencl.VERSION_TEXT}))"


def install_pyopencl(args, report):
    """pyopencl from the wheels brought along, when this Python lacks it."""
    found = _probe(_PYOPENCL_PROBE)
    if "error" not in found:
        report.data["pyopencl"] = found
        return True
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if not wheels:
        report.step("pyopencl", False, 0.0, f"not importable ({found['error'].splitlines()[-1]}) "
                    f"and no wheels in {args.wheels}: prepare them as docs/gpu.md says")
        return False
    rc, out, seconds = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                             "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                             "--target", args.site, *wheels], timeout=300)
    _add_site(args.site)
    names = ", ".join(os.path.basename(w).split("-")[0] + " " + os.path.basename(w).split("-")[1]
                      for w in wheels)
    found = _probe(_PYOPENCL_PROBE)
    ok = rc == 0 and "error" not in found
    report.step(f"pip install --no-index {len(wheels)} wheels into {args.site}", ok, seconds,
                names if ok else out.strip()[-1500:] or found.get("error", ""))
    report.data["pyopencl"] = found
    return ok


_PAGEDKV_PROBE = ("import json, pagedkv; print(json.dumps({'file': pagedkv.__file__, "
                  "'version': pagedkv.__version__, 'backends': pagedkv.available_backends()}))")


def build_requirements():
    """What building pagedkv from source needs and this machine lacks (empty: nothing)."""
    missing = []
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        missing.append(f"a C compiler ({cc!r}, Python's CC, is not on PATH)")
    try:
        import Cython
        if int(Cython.__version__.split(".")[0]) < 3:
            missing.append(f"Cython >= 3 (found {Cython.__version__})")
    except ImportError:
        missing.append("Cython >= 3 (not installed)")
    try:
        import setuptools
        version = tuple(int(p) for p in setuptools.__version__.split(".")[:1])
        if version < MIN_SETUPTOOLS:
            missing.append(f"setuptools >= {MIN_SETUPTOOLS[0]} (found {setuptools.__version__})")
    except ImportError:
        missing.append(f"setuptools >= {MIN_SETUPTOOLS[0]} (not installed)")
    if not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"):
        missing.append(f"Python's headers ({sysconfig.get_paths()['include']}/Python.h)")
    return missing


def install_pagedkv(args, report):
    """pagedkv built from this checkout unless an importable build is there (and no
    ``--build``); False, with what is missing, when it cannot be built."""
    found = _probe(_PAGEDKV_PROBE)
    if "error" not in found and not args.build:
        report.data["pagedkv"] = found
        return True
    missing = build_requirements()
    if missing:
        report.step("build pagedkv", False, 0.0, "cannot build pagedkv from source here: "
                    "missing " + "; ".join(missing))
        return False
    rc, out, seconds = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                             "--no-build-isolation", "--no-deps", "--no-cache-dir", "--upgrade",
                             "--target", args.site, ROOT], timeout=600)
    _add_site(args.site)
    found = _probe(_PAGEDKV_PROBE)
    ok = rc == 0 and "error" not in found
    report.step(f"pip install --no-build-isolation --no-deps {ROOT} (into {args.site})", ok,
                seconds, "" if ok else out.strip()[-2500:] or found.get("error", ""))
    report.data["pagedkv"] = found
    return ok


_PLATFORMS_PROBE = ("import json, pyopencl as cl\n"
                    "try:\n    ps = cl.get_platforms()\nexcept cl.Error:\n    ps = []\n"
                    "print(json.dumps([p.name.strip() + ' ' + p.version.strip() for p in ps]))")


def find_library(name, dirs=LIBRARY_DIRS):
    """The absolute path of shared library ``name`` (``ldconfig``'s cache, then ``dirs``
    and ``$LD_LIBRARY_PATH``), or None."""
    rc, out, _ = _run(["ldconfig", "-p"]) if shutil.which("ldconfig") else (1, "", 0)
    for line in out.splitlines() if rc == 0 else []:
        if line.strip().startswith(name + " ") and "=>" in line:
            path = line.split("=>")[-1].strip()
            if os.path.exists(path):
                return path
    extra = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    for folder in list(dirs) + extra:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def ensure_icd(library=NVIDIA_LIBRARY, platform_text=NVIDIA_PLATFORM, dirs=LIBRARY_DIRS,
               env=None):
    """Make the OpenCL driver ``library`` visible to the ICD loader when its platform
    (one whose name and version contain ``platform_text``) does not show.

    A container may hold a vendor's OpenCL library (NVIDIA's driver mounts
    ``libnvidia-opencl.so.1``) but not the ICD file in ``/etc/OpenCL/vendors``
    that tells the loader about it.  This writes one into a new temporary
    folder, next to copies of the ICD files the loader read so far, and
    points ``OCL_ICD_VENDORS`` (in ``env``, default ``os.environ``) at it.

    Returns
    -------
    dict
        ``action`` ("none needed", "created", "not possible") and what was
        found: the platforms before (and after), the library, the folder.
    """
    env = os.environ if env is None else env
    before = _probe(_PLATFORMS_PROBE, env=dict(env))
    record = {"platforms_before": before}
    if isinstance(before, list) and any(platform_text.lower() in p.lower() for p in before):
        return dict(record, action="none needed", reason=f"a {platform_text} platform shows")
    path = find_library(library, dirs)
    if path is None:
        return dict(record, action="not possible",
                    reason=f"no {platform_text} platform and no {library} on this machine")
    folder = tempfile.mkdtemp(prefix="pagedkv-icd-")
    vendors = env.get("OCL_ICD_VENDORS") or "/etc/OpenCL/vendors"
    for icd in glob.glob(os.path.join(vendors, "*.icd")) if os.path.isdir(vendors) else []:
        shutil.copy(icd, folder)
    with open(os.path.join(folder, "pagedkv-" + platform_text.lower().replace(" ", "-") + ".icd"),
              "w", encoding="ascii") as f:
        f.write(path + "\n")
    env["OCL_ICD_VENDORS"] = folder
    after = _probe(_PLATFORMS_PROBE, env=dict(env))
    shows = isinstance(after, list) and any(platform_text.lower() in p.lower() for p in after)
    return dict(record, action="created", library=path, folder=folder, platforms_after=after,
                shows=shows, reason=f"{library} found at {path}; OCL_ICD_VENDORS={folder}"
                + ("" if shows else f", but still no {platform_text} platform"))


# -- devices ------------------------------------------------------------------------------
def _info(device, name, default=None):
    try:
        return getattr(device, name)
    except Exception:     # a query this driver does not answer
        return default


def describe_device(cl, device):
    """A device's limits, as the report lists them."""
    from pagedkv.backends import _opencl_device
    extensions = sorted((_info(device, "extensions", "") or "").split())
    half_config = _info(device, "half_fp_config", 0) if "cl_khr_fp16" in extensions else 0
    return {
        "name": short_name(device),
        "label": _opencl_device.device_label(device),
        "index": _opencl_device.device_index(device),
        "type": _opencl_device._kind(cl, device),
        "simulator": _opencl_device.is_simulator(cl, device),
        "vendor": device.vendor.strip(), "driver_version": device.driver_version.strip(),
        "device_version": device.version.strip(),
        "opencl_c_version": (_info(device, "opencl_c_version", "") or "").strip(),
        "compute_units": device.max_compute_units,
        "max_clock_mhz": _info(device, "max_clock_frequency"),
        "global_mem_bytes": device.global_mem_size,
        "max_alloc_bytes": device.max_mem_alloc_size,
        "global_mem_cache_bytes": _info(device, "global_mem_cache_size", 0),
        "local_mem_bytes": device.local_mem_size,
        "local_mem_type": cl.device_local_mem_type.to_string(_info(device, "local_mem_type", 1)),
        "max_work_group_size": device.max_work_group_size,
        "max_work_item_sizes": list(device.max_work_item_sizes),
        "fp16": "cl_khr_fp16" in extensions, "half_fp_config": half_config,
        "fp64": "cl_khr_fp64" in extensions,
        "correctly_rounded_divide_sqrt": bool(_info(device, "single_fp_config", 0) & getattr(
            cl.device_fp_config, "CORRECTLY_ROUNDED_DIVIDE_SQRT", 0)),
        "extensions": extensions,
    }


def short_name(device):
    """``"device name (implementation)"``, e.g. ``"NVIDIA H200 (cuda13.0)"``, for the tables."""
    from opencl_devices import implementation     # tests/: the test ids' names
    return f"{device.name.strip()} ({implementation(device)})"


def list_devices(cl, report):
    """Every platform and device, with its limits, into the report."""
    from pagedkv.backends import _opencl_device
    devices = [dev for _, _, dev in _opencl_device._all_devices(cl)]
    report.data["devices"] = [describe_device(cl, dev) for dev in devices]
    return devices


def choose_devices(cl, devices, wanted, report):
    """The devices to check: those ``wanted`` names, else the GPUs, else every
    device but simulators."""
    from pagedkv.backends import _opencl_device
    if wanted:
        chosen = []
        for entry in filter(None, (e.strip() for e in wanted.split(";"))):
            try:
                found = _opencl_device.find_devices(entry, "--devices")
            except ValueError as exc:     # names no device: the message lists them all
                report.skip(f"--devices {entry!r}", str(exc))
                continue
            chosen += [d for d in found if d not in chosen]
        return chosen
    real = [d for d in devices if not _opencl_device.is_simulator(cl, d)]
    gpus = [d for d in real if d.type & cl.device_type.GPU]
    if not gpus:
        report.skip("GPU devices", "no OpenCL GPU on this machine: the check runs on the "
                    "other devices (" + ", ".join(d.name.strip() for d in real) + ")")
    return gpus or real


# -- the device's ceilings ------------------------------------------------------------------
def _queue(cl, device, context=None):
    """A profiling queue on ``device`` in ``context`` (default: pagedkv's shared one)."""
    from pagedkv.backends._opencl_device import context_for_device
    context = context or context_for_device(device)
    return context, cl.CommandQueue(context, device,
                                    properties=cl.command_queue_properties.PROFILING_ENABLE)


def _best_event_seconds(cl, launch, repeat):
    """Fastest device time of ``launch()`` (which returns an event), after one warm-up."""
    launch().wait()
    best = float("inf")
    for _ in range(repeat):
        event = launch()
        event.wait()
        best = min(best, (event.profile.end - event.profile.start) * 1e-9)
    return best


def _program(context, options):
    from pagedkv.backends._opencl_program import build_program
    with open(os.path.join(HERE, "device_check.cl"), encoding="utf-8") as f:
        return build_program(context, "device_check.cl", tuple(options), source=f.read())


def _group_size(device, kernels, wanted=256):
    """The largest power of two up to ``wanted`` that the device and every kernel allow."""
    limit = min([wanted, device.max_work_group_size, device.max_work_item_sizes[0]]
                + [k.work_group_limit(device) for k in kernels])
    return 1 << (max(int(limit), 1).bit_length() - 1)


def bandwidth(cl, device, sizes, context=None):
    """Copy, read and ``enqueue_copy`` bandwidth over a buffer many times the cache.

    Returns a dict of bytes/s (a copy counts the bytes read and written) and
    the buffer's size."""
    context, queue = _queue(cl, device, context)
    kernels = _program(context, ())
    cache = _info(device, "global_mem_cache_size", 0) or (1 << 20)
    nbytes = min(max(sizes.cache_multiple * cache, sizes.min_buffer), sizes.max_buffer,
                 device.max_mem_alloc_size, device.global_mem_size // 4)
    nbytes -= nbytes % (1 << 16)
    n = nbytes // 16                                    # float4s
    flags = cl.mem_flags
    src = cl.Buffer(context, flags.READ_WRITE, nbytes)
    dst = cl.Buffer(context, flags.READ_WRITE, nbytes)
    copy, read, fill = kernels["copy_f4"], kernels["read_f4"], kernels["fill_f4"]
    wg = _group_size(device, [copy, read, fill])
    fill(queue, (-(-n // wg) * wg,), (wg,), dst=src, n=n, value=1.0)
    per_item = 16
    read_items = -(-n // (per_item * wg)) * wg     # ceil(n / per_item), in whole groups
    sums = cl.Buffer(context, flags.READ_WRITE, 4 * read_items)
    repeat = max(sizes.repeat, 3)
    t_copy = _best_event_seconds(cl, lambda: copy(queue, (-(-n // wg) * wg,), (wg,), src=src,
                                                   dst=dst, n=n), repeat)
    t_read = _best_event_seconds(cl, lambda: read(queue, (read_items,), (wg,), src=src,
                                                   out=sums, n=n, per_item=per_item), repeat)
    total = np.empty(read_items, np.float32)
    cl.enqueue_copy(queue, total, sums)
    if not np.isclose(float(total.sum(dtype=np.float64)), 4.0 * n, rtol=1e-6):
        raise RuntimeError(f"read_f4 summed {total.sum()} over {n} float4s of ones")
    t_driver = _best_event_seconds(cl, lambda: cl.enqueue_copy(queue, dst, src), repeat)
    return {"buffer_bytes": nbytes, "cache_bytes": cache, "work_group": wg,
            "copy": 2 * nbytes / t_copy, "read": nbytes / t_read,
            "enqueue_copy": 2 * nbytes / t_driver}


#: sgemm layouts, best first: (output tile edge, outputs per work-item along an
#: edge, inner-dimension keys staged per step)
SGEMM_LAYOUTS = ((64, 4, 16), (32, 4, 16), (32, 2, 16), (16, 2, 16), (8, 2, 8), (8, 8, 8))


def sgemm_rate(cl, device, sizes, rng, context=None, layouts=None):
    """FLOP/s of ``device_check.cl``'s sgemm on square matrices, in the fastest of the
    layouts that the device's limits take (each tried on a small product
    first: what suits a GPU's work-groups does not suit a CPU's); the result
    is checked against numpy on some rows.  ``layouts``: those to try (default
    :data:`SGEMM_LAYOUTS`)."""
    context, queue = _queue(cl, device, context)
    flags = cl.mem_flags

    def product(ts, wpt, tk, n, repeat):
        rts = ts // wpt
        kernel = _program(context, (f"-DDC_TS={ts}", f"-DDC_WPT={wpt}", f"-DDC_TK={tk}",
                                    "-cl-mad-enable"))["sgemm"]
        if kernel.work_group_limit(device) < rts * rts or \
                kernel.local_memory(device) > device.local_mem_size:
            return None
        n = max(n // ts, 1) * ts
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        a_d = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=a)
        b_d = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=b)
        c_d = cl.Buffer(context, flags.READ_WRITE, a.nbytes)
        t = _best_event_seconds(cl, lambda: kernel(queue, (n // wpt, n // wpt), (rts, rts), M=n,
                                                   N=n, K=n, A=a_d, B=b_d, C=c_d), repeat)
        c = np.empty_like(a)
        cl.enqueue_copy(queue, c, c_d)
        rows = np.unique(np.r_[0:4, n - 4:n])
        expected = a[rows].astype(np.float64) @ b.astype(np.float64)
        if not np.allclose(c[rows], expected, rtol=1e-3, atol=1e-3 * np.sqrt(n)):
            raise RuntimeError(f"sgemm {ts}/{wpt}/{tk}: the product differs from numpy's by up "
                               f"to {np.abs(c[rows] - expected).max():.3g}")
        return {"flops": 2.0 * n ** 3 / t, "n": n, "tile": ts, "per_work_item": wpt, "depth": tk}

    fits = [(ts, wpt, tk) for ts, wpt, tk in layouts or SGEMM_LAYOUTS
            if (ts // wpt) ** 2 <= device.max_work_group_size
            and ts // wpt <= min(device.max_work_item_sizes[:2])
            and 2 * tk * ts * 4 <= device.local_mem_size // 2]
    trials = [(layout, product(*layout, min(256, sizes.sgemm_n), 2)) for layout in fits]
    trials = [(layout, r) for layout, r in trials if r is not None]
    if not trials:
        raise RuntimeError("no sgemm layout fits this device's work-group and local-memory limits")
    best = max(trials, key=lambda trial: trial[1]["flops"])[0]
    result = product(*best, sizes.sgemm_n, max(sizes.repeat, 3))
    result["layouts_tried"] = {f"{ts}/{wpt}/{tk}": r["flops"] for (ts, wpt, tk), r in trials}
    return result


# -- pagedkv's attention on the device ---------------------------------------------------------
def _time_steps(cache, step, repeat):
    """Best wall and kernel (profiling events) seconds of ``step()`` over ``repeat`` runs."""
    step()
    wall = kernel = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        wall = min(wall, time.perf_counter() - t0)
        kernel = min(kernel, cache._backend.last_attention_kernel_seconds)
    return wall, kernel


def _checked(out, ref, dtype):
    """Whether ``out`` matches the float64 reference within the tests' tolerance for
    ``dtype``, and the largest difference."""
    from reference import TOLERANCE
    tolerance = TOLERANCE["float32" if dtype == "int8" else dtype]
    return bool(np.allclose(out, ref, **tolerance)), float(np.abs(out - ref).max())


def decode_case(dtype, num_seqs, seq_len, repeat, rng, window=None):
    """One decode step of ``num_seqs`` sequences of ``seq_len`` tokens (the last one
    stored in the step, as an engine does), timed, then checked on its first
    sequence against a dense reference over what ``gather`` returns."""
    from bench_attention import decode_step, fill_cache
    from reference import dense_attention
    cache, seqs, _, _ = fill_cache("opencl", dtype, num_seqs, seq_len - 1, NUM_KV_HEADS,
                                   HEAD_DIM, PAGE_SIZE, rng, keep_contiguous=False)
    q = rng.standard_normal((num_seqs, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    k1 = rng.standard_normal((num_seqs, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
    variant = {"sliding_window": window} if window else {}
    wall, kernel = _time_steps(cache, decode_step(cache, seqs, seq_len, q, k1, **variant), repeat)
    batch = cache.append(seqs, 1)
    cache.store(0, batch, k1, k1)
    out = cache.attention(0, batch, q, **variant)
    k, v = cache.gather(0, seqs[0])
    ref = dense_attention(q[:1], k, v, [seq_len - 1], **variant)
    ok, diff = _checked(out[:1], ref, dtype)
    keys = min(seq_len, window) if window else seq_len
    nbytes = 2 * num_seqs * keys * NUM_KV_HEADS * cache.storage.row_bytes(HEAD_DIM)
    layout = cache._backend.layout
    del cache
    gc.collect()
    return {"wall_s": wall, "kernel_s": kernel, "bytes": nbytes, "correct": ok,
            "max_abs_diff": diff, "layout": _layout(layout)}


def prefill_case(num_tokens, repeat, rng, dtype="float16"):
    """One causal prefill of ``num_tokens`` tokens, timed; its last rows checked."""
    import pagedkv
    from bench_attention import prefill_step
    from reference import dense_attention
    cache = pagedkv.PagedKVCache(1, NUM_KV_HEADS, HEAD_DIM, num_pages=-(-num_tokens // PAGE_SIZE),
                                 page_size=PAGE_SIZE, dtype=dtype, backend="opencl")
    s = cache.add_sequence()
    q = rng.standard_normal((num_tokens, NUM_HEADS, HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32)
    wall, kernel = _time_steps(cache, prefill_step(cache, s, q, k), repeat)
    batch = cache.append([s], num_tokens)
    cache.store(0, batch, k, k)
    out = cache.attention(0, batch, q)
    kept, _ = cache.gather(0, s)
    last = np.arange(num_tokens - 4, num_tokens)
    ok, diff = _checked(out[last], dense_attention(q[last], kept, kept, last), dtype)
    del cache
    gc.collect()
    # QK^T and PV over the causal half, as bench_attention.py counts them
    return {"wall_s": wall, "kernel_s": kernel, "flops": 4.0 * num_tokens * num_tokens / 2
            * NUM_HEADS * HEAD_DIM, "correct": ok, "max_abs_diff": diff}


def latent_available():
    """None when pagedkv has the latent layout (``kv_layout="latent"``), else why not."""
    import pagedkv
    if "kv_layout" in inspect.signature(pagedkv.PagedKVCache).parameters:
        return None
    return (f"pagedkv {pagedkv.__version__} has no latent layout yet (PagedKVCache takes no "
            f"kv_layout; DESIGN.md's 'Latent attention')")


#: DeepSeek V3's absorbed MLA decode: one latent row of 576 per token (512 + 64
#: rotary), 128 query heads, values the first 512 columns.
LATENT_DIM, LATENT_V_DIM, LATENT_HEADS = 576, 512, 128


def latent_decode_case(num_seqs, seq_len, repeat, rng, dtype="float16"):
    """Latent decode per DESIGN.md's contract (``kv_layout="latent"``): the rows are
    read once for every head; checked like ``decode_case``."""
    import pagedkv
    from reference import dense_attention
    pages = num_seqs * -(-seq_len // PAGE_SIZE)
    cache = pagedkv.PagedKVCache(1, 1, LATENT_DIM, num_pages=pages, page_size=PAGE_SIZE,
                                 dtype=dtype, backend="opencl", kv_layout="latent",
                                 v_head_dim=LATENT_V_DIM)
    seqs = [cache.add_sequence() for _ in range(num_seqs)]
    for s in seqs:
        rows = rng.standard_normal((seq_len - 1, 1, LATENT_DIM), dtype=np.float32)
        cache.store(0, cache.append([s], seq_len - 1), rows)
    q = rng.standard_normal((num_seqs, LATENT_HEADS, LATENT_DIM), dtype=np.float32)
    k1 = rng.standard_normal((num_seqs, 1, LATENT_DIM), dtype=np.float32)
    scale = LATENT_DIM ** -0.5

    def step():
        batch = cache.append(seqs, 1)
        cache.store(0, batch, k1)
        out = cache.attention(0, batch, q, scale=scale)
        for s in seqs:
            cache.truncate(s, seq_len - 1)
        return out
    wall, kernel = _time_steps(cache, step, repeat)
    batch = cache.append(seqs, 1)
    cache.store(0, batch, k1)
    out = cache.attention(0, batch, q, scale=scale)
    k, v = cache.gather(0, seqs[0])
    ok, diff = _checked(out[:1], dense_attention(q[:1], k, v, [seq_len - 1], scale=scale), dtype)
    nbytes = num_seqs * seq_len * cache.storage.row_bytes(LATENT_DIM)
    cache = None    # its device buffers go now, not at the next case
    gc.collect()
    return {"wall_s": wall, "kernel_s": kernel, "bytes": nbytes, "correct": ok,
            "max_abs_diff": diff}


def recurrent_available():
    """None when pagedkv has recurrent layers (``layer_states``), else why not."""
    import pagedkv
    if "layer_states" in inspect.signature(pagedkv.PagedKVCache).parameters:
        return None
    return (f"pagedkv {pagedkv.__version__} has no recurrent layers yet (PagedKVCache takes no "
            f"layer_states; DESIGN.md's 'Recurrent layers')")


#: A Qwen3.5 gated DeltaNet layer's recurrence: 16 k-heads, 32 v-heads of 128 x 128
#: (a 2 MiB state per sequence).
DELTA_K_HEADS, DELTA_V_HEADS, DELTA_DIM = 16, 32, 128


def delta_rule_decode_case(num_seqs, repeat, rng):
    """One decode token of ``num_seqs`` sequences through ``gated_delta_rule``: each
    sequence's state is read and written once (the bytes counted); checked on the
    first sequence against a float64 step from the state read before it."""
    import pagedkv
    from _common import best_seconds
    shape = (DELTA_V_HEADS, DELTA_DIM, DELTA_DIM)
    cache = pagedkv.PagedKVCache(1, 1, 16, num_pages=num_seqs * (repeat + 4), page_size=16,
                                 backend="opencl", num_state_slots=num_seqs,
                                 layer_states=[pagedkv.StateSpec([shape])])
    seqs = [cache.add_sequence() for _ in range(num_seqs)]
    n = num_seqs
    qk = [rng.standard_normal((n, DELTA_K_HEADS, DELTA_DIM), dtype=np.float32) for _ in "qk"]
    v = rng.standard_normal((n, DELTA_V_HEADS, DELTA_DIM), dtype=np.float32)
    g = -rng.random((n, DELTA_V_HEADS), dtype=np.float32)
    beta = rng.random((n, DELTA_V_HEADS), dtype=np.float32)

    def step():
        batch = cache.append(seqs, 1)
        return cache.gated_delta_rule(0, batch, qk[0], qk[1], v, g, beta, qk_l2norm=True,
                                      state=0)
    wall = best_seconds(step, repeat=repeat, warmup=1)
    (before,) = cache.read_state(0, seqs[0])
    out = step()
    S, ref = before.astype(np.float64), np.empty((DELTA_V_HEADS, DELTA_DIM))
    group = DELTA_V_HEADS // DELTA_K_HEADS
    for h in range(DELTA_V_HEADS):
        q0, k0 = (x[0, h // group].astype(np.float64) for x in qk)
        q0, k0 = (x / np.sqrt(x @ x + 1e-6) for x in (q0, k0))
        S[h] *= np.exp(g[0, h])
        S[h] += np.outer(k0, beta[0, h] * (v[0, h] - S[h].T @ k0))
        ref[h] = S[h].T @ q0 * DELTA_DIM ** -0.5
    ok, diff = _checked(out[0], ref, "float32")
    cache = None
    gc.collect()
    return {"wall_s": wall, "kernel_s": wall, "bytes": 2 * num_seqs * 4 * int(np.prod(shape)),
            "correct": ok, "max_abs_diff": diff}


def _layout(layout):
    keys = ("kind", "work_group_size", "vector_width", "max_queries", "chunk", "query_tile",
            "key_tile", "column_tile", "stage_k", "stage_v", "merge_work_group_size",
            "local_memory", "max_work_item_iterations")
    return {k: getattr(layout, k) for k in keys if hasattr(layout, k)}


def attention_cases(sizes, ceilings, report, rng):
    """pagedkv's cases on the current device (``$PAGEDKV_DEVICE``), each with its
    ratio to the device's read bandwidth or sgemm rate."""
    B, L = sizes.num_seqs, sizes.seq_len
    read, flops = ceilings.get("read_ceiling"), ceilings.get("sgemm_ceiling")
    plan = [(f"decode {B} x {L}, float16", "float16", lambda: decode_case(
                "float16", B, L, sizes.repeat, rng)),
            (f"decode {B} x {L}, float32", "float32", lambda: decode_case(
                "float32", B, L, sizes.repeat, rng)),
            (f"decode {B} x {L}, int8", "int8", lambda: decode_case(
                "int8", B, L, sizes.repeat, rng)),
            (f"decode {B} x {sizes.window_seq_len}, window {sizes.window}, float16", "float16",
             lambda: decode_case("float16", B, sizes.window_seq_len, sizes.repeat, rng,
                                 window=sizes.window)),
            (f"prefill {sizes.prefill_len}, causal, float16", "float16", lambda: prefill_case(
                sizes.prefill_len, max(2, sizes.repeat // 2), rng))]
    cases = []
    latent = latent_available()
    if latent is None:
        plan.append((f"latent decode {B} x {L}, {LATENT_HEADS} heads, float16", "float16",
                     lambda: latent_decode_case(B, L, sizes.repeat, rng)))
    if recurrent_available() is None:
        plan.append((f"gated delta rule decode {B} x 1, {DELTA_V_HEADS} heads of "
                     f"{DELTA_DIM} x {DELTA_DIM} (wall time)", "float32",
                     lambda: delta_rule_decode_case(B, sizes.repeat, rng)))
    for name, dtype, run in plan:
        if report.left() < 30:
            cases.append({"case": name, "skipped": "the time budget is spent"})
            continue
        t0 = time.monotonic()
        try:
            result = run()
        except Exception as exc:
            cases.append({"case": name, "error": _error(exc)})
            print(f"  {name}: {_error(exc)}", flush=True)
            continue
        if "bytes" in result:
            result["rate"] = result["bytes"] / result["kernel_s"]
            result["unit"], result["ceiling"] = "GB/s", "read bandwidth"
            result["ratio"] = result["rate"] / read if read else None
        else:
            result["rate"] = result["flops"] / result["kernel_s"]
            result["unit"], result["ceiling"] = "GFLOP/s", "sgemm rate"
            result["ratio"] = result["rate"] / flops if flops else None
        result.update(case=name, dtype=dtype, seconds=round(time.monotonic() - t0, 1))
        cases.append(result)
        print(f"  {name}: {result['kernel_s'] * 1e3:.3f} ms kernels, "
              f"{result['rate'] / 1e9:.1f} {result['unit']}"
              + (f", {result['ratio']:.2f}x the {result['ceiling']}" if result["ratio"] else "")
              + ("" if result["correct"] else " (WRONG RESULT)"), flush=True)
    if latent is not None:
        cases.append({"case": "latent decode (MLA)", "skipped": latent})
    return cases


def check_device(cl, device, args, report, rng):
    """Ceilings and attention cases on one device; its part of the report."""
    from pagedkv.backends._opencl_device import device_index, device_label
    kind = "gpu" if device.type & cl.device_type.GPU else "cpu"
    sizes = Sizes(kind, args.quick)
    entry = {"name": short_name(device), "label": device_label(device),
             "index": device_index(device), "kind": kind, "sizes": sizes.as_dict()}
    print(f"\n## {entry['label']} ({entry['index']})", flush=True)
    ceilings = {}
    try:
        ceilings.update(bandwidth(cl, device, sizes))
    except Exception as exc:
        ceilings["bandwidth_error"] = _error(exc)
    try:
        product = sgemm_rate(cl, device, sizes, rng)
        ceilings["sgemm"] = product.pop("flops")
        ceilings["sgemm_shape"] = product
    except Exception as exc:
        ceilings["sgemm_error"] = _error(exc)
    if kind == "cpu":
        # A CPU device is the host's cores: their best read and matrix product
        # (C/OpenMP, torch or numpy BLAS; bench_attention.py's) bound it too.
        from _common import StreamRead
        from bench_attention import sgemm_rate as host_sgemm_rate
        stream = StreamRead(ceilings.get("buffer_bytes", 256 << 20))
        ceilings["host_read"] = stream.bandwidth(repeat=max(sizes.repeat, 3))
        ceilings["host_read_what"] = stream.what
        ceilings["host_sgemm"] = host_sgemm_rate(rng, n=256 if args.quick else 1024)
    # ratios are taken to the better of each pair: never flattering
    ceilings["read_ceiling"] = max(ceilings.get("read", 0), ceilings.get("host_read", 0)) or None
    ceilings["sgemm_ceiling"] = max(ceilings.get("sgemm", 0),
                                    ceilings.get("host_sgemm", 0)) or None
    entry["ceilings"] = ceilings
    print("  ceilings: " + ", ".join(f"{k} {ceilings[k] / 1e9:.1f} G/s" for k in
                                     ("copy", "read", "enqueue_copy", "sgemm", "host_read",
                                      "host_sgemm") if k in ceilings), flush=True)
    os.environ["PAGEDKV_DEVICE"] = entry["index"]
    try:
        entry["cases"] = attention_cases(sizes, ceilings, report, rng)
    finally:
        del os.environ["PAGEDKV_DEVICE"]
    return entry


# -- torch on the same GPU ------------------------------------------------------------------
def torch_comparison(args, report, opencl_read, rng):
    """The same decode and prefill through torch's SDPA on CUDA, and torch's own
    ceilings; None (and a skip) without torch or CUDA.

    ``args.torch_device`` "cpu" runs it all on the CPU with wall-clock timers
    instead: no comparison, but the code path, for the tests of this script.
    """
    try:
        import torch
    except ImportError as exc:
        report.skip("torch comparison", f"torch is not installed ({exc})")
        return None
    on_cpu = args.torch_device == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        report.skip("torch comparison", f"torch {torch.__version__} sees no CUDA device "
                    f"(built for CUDA {torch.version.cuda})")
        return None
    import torch.nn.functional as F
    quick = args.quick
    result = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": "CPU (test of the code path)" if on_cpu else torch.cuda.get_device_name(0)}
    dev = torch.device(args.torch_device)

    def cuda_seconds(fn, repeat=10):
        """Best device time of ``fn()`` (CUDA events; wall clock on the CPU)."""
        fn()
        if on_cpu:
            return min(_wall(fn) for _ in range(min(repeat, 3)))
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e-3)
        return best

    nbytes = (16 if quick else 2048) << 20
    x = torch.ones(nbytes // 4, device=dev)
    y = torch.empty_like(x)
    result["copy"] = 2 * nbytes / cuda_seconds(lambda: y.copy_(x))
    result["read"] = nbytes / cuda_seconds(lambda: x.sum())
    x = y = None
    n = 256 if quick else 8192
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.float32, torch.float16):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        result[f"mm_{str(dtype)[6:]}"] = 2 * n ** 3 / cuda_seconds(lambda: a @ a, 5)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = None

    sizes = Sizes("gpu", quick)
    B, L, N = sizes.num_seqs, sizes.seq_len, sizes.prefill_len
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]

    def sdpa_rows(q, k, v, causal, work, unit):
        rows = []
        for backend in backends:
            name = "SDPA (torch's choice)" if backend is None else f"SDPA {backend.name}"
            try:
                def run():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=True)
                if backend is None:
                    t = cuda_seconds(run)
                    picked = None if on_cpu else _kernel_names(torch, run)
                else:
                    with sdpa_kernel([backend]):
                        t = cuda_seconds(run)
                    picked = None
                rows.append({"name": name, "seconds": t, "rate": work / t, "unit": unit,
                             "kernels": picked})
            except Exception as exc:    # a backend that does not take these inputs
                rows.append({"name": name, "unavailable": _error(exc)})
        return rows

    cases = []
    for dtype in (torch.float16, torch.float32):
        q = torch.randn(B, NUM_HEADS, 1, HEAD_DIM, device=dev, dtype=dtype)
        k = torch.randn(B, NUM_KV_HEADS, L, HEAD_DIM, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        work = 2 * k.numel() * k.element_size()
        cases.append({"case": f"decode {B} x {L}, {str(dtype)[6:]}, contiguous",
                      "rows": sdpa_rows(q, k, v, False, work, "GB/s")})
        del q, k, v
    q = torch.randn(1, NUM_HEADS, N, HEAD_DIM, device=dev, dtype=torch.float16)
    k = torch.randn(1, NUM_KV_HEADS, N, HEAD_DIM, device=dev, dtype=torch.float16)
    cases.append({"case": f"prefill {N}, causal, float16, contiguous",
                  "rows": sdpa_rows(q, k, k, True, 4.0 * N * N / 2 * NUM_HEADS * HEAD_DIM,
                                    "GFLOP/s")})
    del q, k
    if not on_cpu:
        torch.cuda.empty_cache()
    for case in cases:
        for row in case["rows"]:
            if "rate" in row and row["unit"] == "GB/s":
                row["ratio_opencl_read"] = row["rate"] / opencl_read if opencl_read else None
                row["ratio_torch_read"] = row["rate"] / result["read"]
            elif "rate" in row:
                row["ratio_torch_mm_float16"] = row["rate"] / result["mm_float16"]
    result["cases"] = cases
    return result


def _kernel_names(torch, run):
    """The CUDA kernels one call of ``run`` launches, longest first (which SDPA
    implementation torch picked: flash, efficient, cudnn or math)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if "CUDA" in str(getattr(e, "device_type", ""))]
        events.sort(key=lambda e: -(getattr(e, "device_time_total", None)
                                    or getattr(e, "cuda_time_total", 0)))
        return [e.key[:80] for e in events[:3]]
    except Exception as exc:       # the profiler is a nicety: its failure is no failure
        return [f"(profiler: {_error(exc)})"]


def _wall(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def versus_torch(checked, chosen, torch_part, cl):
    """pagedkv's float16 decode and prefill on the GPU against torch's choice of SDPA
    on the same shapes: (pagedkv kernel time) / (torch's time)."""
    if not torch_part:
        return []
    gpu = next((c for c, d in zip(checked, chosen) if d.type & cl.device_type.GPU), None)
    if gpu is None:
        return []
    pairs = []
    for ours, theirs in (("decode", "decode"), ("prefill", "prefill")):
        case = next((c for c in gpu.get("cases", []) if c["case"].startswith(ours)
                     and c.get("dtype") == "float16" and "kernel_s" in c
                     and "window" not in c["case"]), None)
        other = next((t for t in torch_part["cases"] if t["case"].startswith(theirs)
                      and "float16" in t["case"]), None)
        row = other and next((r for r in other["rows"] if r["name"].startswith("SDPA (torch")
                              and "seconds" in r), None)
        if case and row:
            pairs.append({"pagedkv": case["case"], "torch": other["case"],
                          "pagedkv_s": case["kernel_s"], "torch_s": row["seconds"],
                          "time_ratio": case["kernel_s"] / row["seconds"]})
    return pairs


# -- the tests -----------------------------------------------------------------------------------
def run_tests(device_index, args, seconds):
    """pytest's OpenCL tests on one device (``PAGEDKV_TEST_DEVICES``), stopped after
    ``seconds``; the counts and the first failures."""
    outcomes = tempfile.NamedTemporaryFile(prefix="pagedkv-outcomes-", suffix=".jsonl",
                                           delete=False).name
    env = dict(os.environ, PAGEDKV_TEST_DEVICES=device_index, PAGEDKV_TEST_OUTCOMES=outcomes,
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    env.pop("PAGEDKV_DEVICE", None)
    select = (["tests/test_opencl.py", "-k", "same_results_as_host and float16"] if args.quick
              else ["tests", "-m", "not slow", "-k", "opencl"])
    workers = args.test_workers
    if workers is None:    # xdist where it is installed and there are cores to spare
        workers = min(8, os.cpu_count() or 1) if _has_xdist() and (os.cpu_count() or 1) >= 8 else 0
    cmd = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "pytest",
           "-q", "-p", "no:cacheprovider", "-p", "_test_outcomes", *select,
           *(["-n", str(workers)] if workers else [])]
    # -P: the checkout's folder must not shadow an installed (non-editable) pagedkv
    rc, out, took = _run(cmd, env=env, cwd=ROOT, timeout=max(seconds, 10))
    counts, failures = read_outcomes(outcomes)
    os.unlink(outcomes)
    summary = out.strip().splitlines()[-1:] if out.strip() else []
    return {"command": " ".join(cmd[1:]), "workers": workers, "seconds": round(took, 1),
            "complete": rc != 124, "exit_status": rc, **counts, "first_failures": failures,
            "summary": summary[0] if summary else "",
            "output_tail": out[-2000:] if rc not in (0, 1, 124) else ""}


def read_outcomes(path, first=5):
    """The counts of a ``_test_outcomes`` file (passed, failed, error, skipped: a
    failure in setup or teardown is an error) and its ``first`` failures."""
    per_test = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            state = per_test.setdefault(rec["nodeid"], {"outcome": "passed"})
            if rec["outcome"] == "failed":
                if state["outcome"] not in ("failed", "error"):
                    state["outcome"] = "failed" if rec["when"] == "call" else "error"
                    state["message"] = rec.get("message", "")
            elif rec["outcome"] == "skipped" and state["outcome"] == "passed":
                state["outcome"] = "skipped"
                state["message"] = rec.get("message", "")
    counts = {k: sum(1 for s in per_test.values() if s["outcome"] == k)
              for k in ("passed", "failed", "error", "skipped")}
    failures = [{"test": nodeid, "message": s.get("message", "")[-1200:]}
                for nodeid, s in per_test.items() if s["outcome"] in ("failed", "error")][:first]
    return counts, failures


def _has_xdist():
    try:
        import xdist  # noqa: F401
        return True
    except ImportError:
        return False


# -- the report ----------------------------------------------------------------------------------
def _g(x, scale=1e9, digits=1):
    return "-" if x is None else f"{x / scale:.{digits}f}"


def render(data):
    """report.md's text: the tables."""
    from _common import fmt_table
    out = [f"# pagedkv device check, {data['started']}", "",
           f"{data.get('mode', '')} run, {data.get('elapsed_s', 0):.0f} s of a {data['budget_s']} s "
           f"budget; Python {data['python']}, pyopencl {data.get('pyopencl', '?')}, pagedkv "
           f"{data.get('pagedkv', {}).get('version', '?')} ({data.get('pagedkv', {}).get('file', '?')})", ""]
    if data.get("mode") == "quick":
        out += ["Quick mode: a smoke run of every step at sizes too small (inside the caches, "
                "dominated by launches) for its figures and ratios to mean anything.", ""]
    if data["install"]:
        out += ["## Install", "", fmt_table(["step", "ok", "s", "detail"], [
            [s["step"], "yes" if s["ok"] else "NO", s["seconds"], s["detail"][:300].replace("\n", " ")]
            for s in data["install"]]), ""]
    icd = data.get("icd")
    if icd:
        out += [f"ICD: {icd['action']}: {icd.get('reason', '')}", ""]
    if data["devices"]:
        out += ["## OpenCL devices", "", fmt_table(
            ["P:D", "device", "type", "CUs", "local mem", "max WG", "cache", "global mem",
             "fp16", "fp64", "OpenCL C"],
            [[d["index"], d["name"], d["type"], d["compute_units"],
              f"{d['local_mem_bytes'] // 1024} KiB {d['local_mem_type']}", d["max_work_group_size"],
              f"{d['global_mem_cache_bytes'] / 2**20:.1f} MiB", f"{d['global_mem_bytes'] / 2**30:.1f} GiB",
              "yes" if d["fp16"] else "no", "yes" if d["fp64"] else "no", d["opencl_c_version"]]
             for d in data["devices"]]), ""]
        for d in data["devices"]:
            out.append(f"- {d['index']} extensions: {' '.join(d['extensions'])}")
        out.append("")
    checked = data["checked"]
    if checked:
        out += ["## Ceilings (measured on each device)", "", fmt_table(
            ["device", "buffer", "copy GB/s", "read GB/s", "enqueue_copy GB/s", "sgemm GFLOP/s",
             "host read GB/s", "host sgemm GFLOP/s"],
            [[c["name"], f"{c['ceilings'].get('buffer_bytes', 0) / 2**20:.0f} MiB "
              f"({c['ceilings'].get('buffer_bytes', 0) / max(c['ceilings'].get('cache_bytes', 1), 1):.0f}x cache)",
              _g(c["ceilings"].get("copy")), _g(c["ceilings"].get("read")),
              _g(c["ceilings"].get("enqueue_copy")), _g(c["ceilings"].get("sgemm")),
              _g(c["ceilings"].get("host_read")), _g(c["ceilings"].get("host_sgemm"))]
             for c in checked]), "",
            "OpenCL kernels of benchmarks/device_check.cl (a copy counts bytes read and "
            "written); for a CPU device also the host's own read and BLAS product on the same "
            "cores. Ratios below are to the better of each pair.", ""]
        for c in checked:
            for key in ("bandwidth_error", "sgemm_error"):
                if key in c["ceilings"]:
                    out.append(f"- {c['name']}: {key}: {c['ceilings'][key]}")
        out += ["## pagedkv attention (OpenCL)", "", summary_table(checked), ""]
        layouts = {c["name"]: next((x["layout"] for x in c.get("cases", []) if "layout" in x), None)
                   for c in checked}
        for label, layout in layouts.items():
            if layout:
                out.append(f"- {label}: layout " + ", ".join(f"{k}={v}" for k, v in layout.items()))
        out += ["", "## OpenCL tests", "", fmt_table(
            ["device", "passed", "failed", "errors", "skipped", "s", "complete"],
            [[c["name"], t["passed"], t["failed"], t["error"], t["skipped"], t["seconds"],
              "yes" if t["complete"] else "NO (time limit)"]
             for c in checked for t in [c.get("tests")] if t]), ""]
        for c in checked:
            t = c.get("tests") or {}
            for f in t.get("first_failures", []):
                out += [f"- {c['name']}: `{f['test']}`", "", "```", f["message"][-800:], "```"]
    torch_part = data.get("torch")
    if torch_part:
        out += ["## torch on the same GPU", "",
                f"torch {torch_part['torch']} (CUDA {torch_part['cuda']}) on {torch_part['device']}: "
                f"copy {_g(torch_part['copy'])} GB/s, read (sum) {_g(torch_part['read'])} GB/s, "
                f"mm float32 {_g(torch_part['mm_float32'], 1e12, 2)} TFLOP/s, "
                f"mm float16 {_g(torch_part['mm_float16'], 1e12, 2)} TFLOP/s", ""]
        rows = []
        for case in torch_part["cases"]:
            for r in case["rows"]:
                if "unavailable" in r:
                    rows.append([case["case"], r["name"], "-", "-", "-", r["unavailable"][:120]])
                    continue
                ratio = r.get("ratio_opencl_read", r.get("ratio_torch_mm_float16"))
                basis = "x OpenCL read" if "ratio_opencl_read" in r else "x torch mm float16"
                rows.append([case["case"], r["name"], f"{r['seconds'] * 1e3:.3f}",
                             f"{r['rate'] / 1e9:.1f} {r['unit']}",
                             "-" if ratio is None else f"{ratio:.2f} {basis}",
                             ", ".join(r["kernels"] or [])[:120] if r.get("kernels") else ""])
        out += [fmt_table(["case", "torch", "ms", "rate", "ratio", "kernels (torch's choice)"], rows), ""]
        for pair in data.get("versus_torch") or []:
            out.append(f"- pagedkv {pair['pagedkv']} takes {pair['time_ratio']:.2f}x the time of "
                       f"torch's SDPA {pair['torch']} ({pair['pagedkv_s'] * 1e3:.3f} ms against "
                       f"{pair['torch_s'] * 1e3:.3f} ms)")
        out.append("")
    if data["skipped"]:
        out += ["## Skipped", "", fmt_table(["what", "why"], [
            [s["what"], " ".join(s["reason"].split())] for s in data["skipped"]]), ""]
    return "\n".join(out)


def summary_table(checked):
    """The table the check prints: every case of every device, with its ratio."""
    from _common import fmt_table
    rows = []
    for c in checked:
        for case in c.get("cases", []):
            if "skipped" in case or "error" in case:
                rows.append([c["name"], case["case"], "-", "-", "-", "-",
                             ("not available: " + case["skipped"]) if "skipped" in case
                             else "ERROR " + case["error"]])
                continue
            rows.append([c["name"], case["case"], f"{case['kernel_s'] * 1e3:.3f}",
                         f"{case['wall_s'] * 1e3:.3f}", f"{case['rate'] / 1e9:.1f} {case['unit']}",
                         "-" if case["ratio"] is None else f"{case['ratio']:.2f} x {case['ceiling']}",
                         "ok" if case["correct"] else f"WRONG (max diff {case['max_abs_diff']:.3g})"])
    return fmt_table(["device", "case", "kernel ms", "wall ms", "rate", "ratio", "result"], rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder for report.md and report.json (made if missing)")
    parser.add_argument("--devices", default=os.environ.get("PAGEDKV_CHECK_DEVICES", ""),
                        help="';'-separated device names or P:D indices (default: every GPU, "
                             "else every device but simulators)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and a few tests: a smoke run of the whole check")
    parser.add_argument("--tests", choices=("run", "none"), default="run",
                        help="run the OpenCL tests on each checked device (default) or not")
    parser.add_argument("--test-workers", type=int, default=None,
                        help="pytest-xdist workers for the tests (default: 8 where xdist is "
                             "installed and there are 8 cores, else none)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds the check may take; later steps are cut short or skipped "
                             "(default 420)")
    parser.add_argument("--wheels", default=os.path.join(ROOT, ".whl"),
                        help="folder of wheels to install pyopencl from when it is missing")
    parser.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "pagedkv-check-site"),
                        help="where missing packages (and a pagedkv build) are installed")
    parser.add_argument("--torch-device", default="cuda", choices=("cuda", "cpu"),
                        help=argparse.SUPPRESS)     # cpu: the tests run the torch code path
    parser.add_argument("--build", action="store_true",
                        help="build pagedkv from this checkout even if one imports")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    report = Report(args.budget)
    data = report.data
    data.update(mode="quick" if args.quick else "full", python=platform.python_version(),
                machine=f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
                argv=sys.argv[1:] if argv is None else list(argv))
    sys.path[:0] = [HERE, TESTS]   # _common, bench_attention; tests/reference.py
    try:
        run_check(args, report)
    except Exception as exc:       # whatever went wrong, the report says it
        data["fatal"] = _error(exc) + "\n" + traceback.format_exc()[-3000:]
        print(data["fatal"], file=sys.stderr)
    data["elapsed_s"] = round(report.elapsed(), 1)
    with open(os.path.join(args.out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
    text = render(data)
    if "fatal" in data:
        text += "\n## Fatal error\n\n```\n" + data["fatal"] + "\n```\n"
    with open(os.path.join(args.out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print("\n" + text, flush=True)
    return 1 if "fatal" in data else 0


def run_check(args, report):
    data = report.data
    os.makedirs(args.site, exist_ok=True)
    have_cl = install_pyopencl(args, report)
    have_pagedkv = install_pagedkv(args, report)
    if not have_cl:
        report.skip("everything on OpenCL", "pyopencl cannot be imported (see Install)")
        return
    icd = ensure_icd()
    data["icd"] = icd
    if icd["action"] != "created":
        report.skip(f"an ICD file for {NVIDIA_LIBRARY}", icd["reason"])
    import pyopencl as cl
    data["pyopencl"] = cl.VERSION_TEXT
    if not have_pagedkv:
        report.skip("the devices, ceilings, attention and tests", "pagedkv cannot be built here "
                    "(see Install)")
        return
    import pagedkv
    data["pagedkv"] = {"file": pagedkv.__file__, "version": pagedkv.__version__,
                       "backends": pagedkv.available_backends()}
    if "opencl" not in pagedkv.available_backends():
        from pagedkv.backends._opencl_device import unavailable_reason
        report.skip("everything on OpenCL", unavailable_reason())
        return
    devices = list_devices(cl, report)
    chosen = choose_devices(cl, devices, args.devices, report)
    rng = np.random.default_rng(0)
    for device in chosen:
        data["checked"].append(check_device(cl, device, args, report, rng))
    gpu_read = next((c["ceilings"].get("read_ceiling") for c, d in zip(data["checked"], chosen)
                     if d.type & cl.device_type.GPU), None)
    if report.left() > 60:
        data["torch"] = torch_comparison(args, report, gpu_read, rng)
        data["versus_torch"] = versus_torch(data["checked"], chosen, data["torch"], cl)
    else:
        report.skip("torch comparison", "the time budget is spent")
    if args.tests == "none":
        report.skip("OpenCL tests", "--tests none")
        return
    for i, entry in enumerate(data["checked"]):
        seconds = (report.left() - 10) / (len(data["checked"]) - i)
        if seconds < 20:
            report.skip(f"OpenCL tests on {entry['label']}", "the time budget is spent")
            continue
        print(f"\n## tests on {entry['label']} (at most {seconds:.0f} s)", flush=True)
        entry["tests"] = run_tests(entry["index"], args, seconds)
        t = entry["tests"]
        print(f"  {t['passed']} passed, {t['failed']} failed, {t['error']} errors, "
              f"{t['skipped']} skipped in {t['seconds']} s"
              + ("" if t["complete"] else " (cut short by the time budget)"), flush=True)


if __name__ == "__main__":
    sys.exit(main())

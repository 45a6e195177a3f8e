import pytest

import pagedkv


@pytest.fixture(params=pagedkv.available_backends())
def backend(request):
    """Each backend usable on this machine; behaviour tests run once per backend."""
    return request.param

"""llama.cpp's ggml library as llama-cpp-python loads it (llama_cpp._ggml.libggml), with
the signatures of the backend and device functions localrt calls, which llama_cpp binds
none of: the RPC backend's (localrt.engines.rpc), the probe's list of backends and GPU
devices (localrt.engines.probe), and the devices llama.cpp's buffers are named after
(localrt.engines.llama.offload). One table, so that every caller sees the same types.
"""

from __future__ import annotations

import ctypes

# enum ggml_backend_dev_type (ggml-backend.h): the devices a model's layers go to.
DEVICE_GPU, DEVICE_IGPU = 1, 2

_P, _S, _N = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
SIGNATURES = (  # (function, restype, argtypes)
    ("ggml_backend_reg_count", _N, []),
    ("ggml_backend_reg_get", _P, [_N]),
    ("ggml_backend_reg_name", _S, [_P]),
    ("ggml_backend_reg_by_name", _P, [_S]),
    ("ggml_backend_reg_get_proc_address", _P, [_P, _S]),
    ("ggml_backend_reg_dev_count", _N, [_P]),
    ("ggml_backend_reg_dev_get", _P, [_P, _N]),
    ("ggml_backend_dev_count", _N, []),
    ("ggml_backend_dev_get", _P, [_N]),
    ("ggml_backend_dev_by_type", _P, [ctypes.c_int]),
    ("ggml_backend_dev_by_name", _P, [_S]),
    ("ggml_backend_dev_type", ctypes.c_int, [_P]),
    ("ggml_backend_dev_name", _S, [_P]),
    ("ggml_backend_dev_description", _S, [_P]),
    ("ggml_backend_dev_memory", None, [_P, ctypes.POINTER(_N), ctypes.POINTER(_N)]),
    ("ggml_set_abort_callback", _P, [_P]))


def libggml():
    """llama_cpp's libggml (its own libraries beside it), every function of
    SIGNATURES typed. ImportError where llama_cpp has no _ggml, AttributeError where the
    library lacks one of them."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    for name, restype, argtypes in SIGNATURES:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib

"""gguf-cpp's start options as llama.cpp's parameters.

Model start options (schemas/model-start.json) become llama.cpp's parameters in
`model_params` (ngl, use_mmap, mlock; rpc_servers: the devices, `rpc_targets`,
localrt.engines.rpc) and `context_params` (ctx_len x n_parallel, n_parallel, n_batch,
cpu_threads, flash_attn: llama.cpp's auto when not given, cache_type); caching_enabled
is the Batcher's (localrt.engines.llama.batch). The embedding mode's llama_cpp.Llama takes
`llama_arguments` instead. If you add a start option, also map it here.
"""

from __future__ import annotations

from pathlib import Path

from localrt.errors import InvalidField

DEFAULT_BATCH = 512  # n_batch when not given (and the most n_ubatch is), llama-cpp-python's
# cache_type -> ggml_type, for the context's type_k and type_v (ggml.h's enum ggml_type),
# and the bytes each value of the KV cache takes in it (ggml's block size / block length).
# If you add one, also add it to the cache_type enum of schemas/model-update.json.
CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
               "iq4_nl": 20, "bf16": 30}
CACHE_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32,
                    "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
# Start options -> llama_cpp.Llama arguments, for the embedding mode's Llama
# (llama_arguments; the batched LlamaModel's are model_params' and context_params').
# If you add a start option, also map it here.
LLAMA_OPTIONS = {"ctx_len": "n_ctx", "ngl": "n_gpu_layers", "cpu_threads": "n_threads",
                 "n_batch": "n_batch", "mlock": "use_mlock", "use_mmap": "use_mmap",
                 "flash_attn": "flash_attn"}
# Quantized V caches need flash attention in llama.cpp.
QUANTIZED_CACHE = tuple(k for k in CACHE_TYPES if k not in ("f32", "f16", "bf16"))


def rpc_targets(llama_cpp, options: dict) -> list[str]:
    """The rpc-servers of the start option `rpc_servers` ("host:port" each); a 400 when
    this llama.cpp has no RPC backend (localrt.engines.catalog names the variant that has)."""
    from localrt.engines import rpc

    if not options.get("rpc_servers"):
        return []
    if not llama_cpp.llama_supports_rpc():
        raise InvalidField("Invalid field 'rpc_servers': the llama.cpp this server loaded "
                           "has no RPC backend; install a gguf-cpp +rpc variant (localrt "
                           "engines install gguf-cpp --variant ...+rpc), or, if it is the "
                           "active one already, restart the server to load it",
                           param="rpc_servers")
    try:
        return rpc.endpoints(rpc.parse_servers(options["rpc_servers"]))
    except ValueError as exc:
        raise InvalidField(f"Invalid field 'rpc_servers': {exc}", param="rpc_servers") \
            from None


def engine_dir(llama_cpp) -> str:
    """The folder llama_cpp was imported from (an engine variant's, or site-packages)."""
    return str(Path(llama_cpp.__file__).resolve().parent.parent)


def model_params(llama_cpp, options: dict):
    """llama_model_params for the start options (ngl, use_mmap, mlock)."""
    params = llama_cpp.llama_model_default_params()
    ngl = options.get("ngl")
    if ngl is not None:
        params.n_gpu_layers = 0x7FFFFFFF if ngl < 0 else ngl  # INT32_MAX: every layer
    mmap, mlock = options.get("use_mmap", True) is not False, bool(options.get("mlock"))
    params.load_mode = {(True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
                        (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
                        (True, False): llama_cpp.LLAMA_LOAD_MODE_MMAP,
                        (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE}[mmap, mlock]
    return params


def context_params(llama_cpp, options: dict, n_ctx: int, slots: int):
    """llama_context_params: `slots` sequences of their own (no unified KV) in n_ctx."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, slots, False
    n_batch = max(options.get("n_batch") or DEFAULT_BATCH, slots)
    params.n_batch, params.n_ubatch = n_batch, min(n_batch, DEFAULT_BATCH)
    threads = options.get("cpu_threads")
    if threads:
        params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = flash_attn_type(llama_cpp, options.get("flash_attn"))
    if options.get("cache_type"):
        params.type_k = params.type_v = CACHE_TYPES[options["cache_type"]]
    params.no_perf = False  # keeps llama.cpp's count of evaluated prompt tokens
    return params


def flash_attn_type(llama_cpp, flash_attn: bool | None) -> int:
    """The chat context's flash attention: on or off as the start option says, and
    when it says nothing llama.cpp's auto, as llama-server's -fa auto (on wherever the
    device has the kernels: every CPU). Without it a long prompt reads 1.5 to 2.5
    times slower on a CPU (tests/bench/bench_long_prompt.py)."""
    if flash_attn is None:
        return llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    return (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def llama_arguments(options: dict) -> dict:
    """llama_cpp.Llama's arguments for the start options (LLAMA_OPTIONS), for the
    embedding mode's Llama."""
    arguments = {LLAMA_OPTIONS[k]: v for k, v in options.items()
                 if k in LLAMA_OPTIONS and v is not None}
    if options.get("cache_type"):
        arguments["type_k"] = arguments["type_v"] = CACHE_TYPES[options["cache_type"]]
    if "n_threads" in arguments:
        arguments["n_threads_batch"] = arguments["n_threads"]
    return arguments

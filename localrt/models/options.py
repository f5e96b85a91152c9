"""Start options: what a model starts with, from its stored parameters, the defaults
and the start request's options (schemas/model-start.json).

`StartOptions.resolve(record, requested)` merges them, the request's over the stored
ones over the defaults, and checks the result against the engine that will load the
model (localrt.engines.catalog): a 400 for a requested option the model cannot take,
a 409 (`InvalidStoredParameter`) that says how to change a stored one.
localrt.inference.scheduler starts a model with what it gives.
"""

from __future__ import annotations

import json

from localrt.engines.catalog import EngineNotFound
from localrt.engines.hardware import available_cores
from localrt.errors import Conflict, InvalidField
from localrt.models.registry import DEFAULT_CTX_LEN

# The start options (schemas/model-start.json): they are also stored model parameters.
# If you add one, also map it in localrt.engines.llama.params and add it to the CLI
# (models start). `embedding` (llama.cpp's embedding mode) is a start option only,
# never stored.
START_OPTIONS = ("prompt_template", "stop", "ngl", "ctx_len", "cpu_threads", "n_batch",
                 "n_parallel", "caching_enabled", "grp_attn_n", "grp_attn_w", "mlock",
                 "flash_attn", "cache_type", "use_mmap", "speculative", "draft_max",
                 "rpc_servers", "reasoning", "reasoning_budget", "engine")
DEFAULT_PARALLEL = 4  # n_parallel (a gguf-cpp model's slots) when nothing says


class InvalidStoredParameter(Conflict):
    """A stored parameter the model cannot start with; `models update` fixes it."""

    code = "invalid_stored_parameter"


class StartOptions:
    """Resolves start options against the engines (`engines`, the catalog's Engines)
    and this machine: by default a model computes with its compute lane's share of the
    cores (`lanes` lanes, `cores` cores; None: those this process may use)."""

    def __init__(self, engines, lanes: int = 1, cores: int | None = None):
        self._engines = engines
        # Each lane's generation gets its share of the cores, so together they never
        # use more threads than there are cores.
        self.default_threads = max(1, (cores or available_cores()) // lanes)

    def resolve(self, record: dict, requested: dict) -> dict:
        """Stored parameters overridden by the request; 400 for what the model cannot take.

        A stored parameter the model cannot take is a 409 that says how to change it.
        """
        stored = {k: record[k] for k in START_OPTIONS if record.get(k) is not None}
        # ngl has no default: left unset, a GPU build fits it to the devices' free
        # memory (localrt.inference.scheduler, localrt.engines.memory.fit).
        options = {"engine": record["engine"], "ctx_len": DEFAULT_CTX_LEN,
                   "cpu_threads": self.default_threads, "caching_enabled": True,
                   "n_parallel": DEFAULT_PARALLEL,
                   **stored, **{k: v for k, v in requested.items() if v is not None}}

        def refuse(name: str, why: str):
            if name in requested:
                raise InvalidField(f"Invalid field '{name}': {why}", param=name)
            raise InvalidStoredParameter(
                f"Model {record['id']} has the stored parameter {name}="
                f"{json.dumps(options[name])}, but {why}; change it with `localrt models "
                f"update {record['id']} --{name} ...` or override it in the start request",
                param=name)

        engine = options["engine"]
        if engine != record["engine"]:
            try:
                self._engines.require_known(engine)
            except EngineNotFound as exc:
                refuse("engine", exc.message[0].lower() + exc.message[1:])
            wanted = self._engines.entry(record["engine"])["format"]
            runs = self._engines.entry(engine)["format"]
            if runs != wanted:
                refuse("engine", f"model {record['id']} is {wanted}, and engine {engine} "
                                 f"runs {runs or 'other'} models")
        trained = (record.get("metadata") or {}).get("context_length")
        if isinstance(trained, int) and options["ctx_len"] > trained:
            if "ctx_len" in requested:
                refuse("ctx_len", f"{options['ctx_len']} is beyond the {trained} tokens "
                                  f"model {record['id']} was trained on")
            options["ctx_len"] = trained
        for name, why in self._engines.check_options(engine, options):
            refuse(name, why)
        template = options.get("prompt_template")
        if template is not None and "{prompt}" not in template:
            refuse("prompt_template", "it needs a {prompt} placeholder")
        return options

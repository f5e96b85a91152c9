"""LoRA adapters on a gguf-cpp model, as llama-server applies them.

A model record's adapters (localrt.models.roles.ADAPTER) reach the engine as the start
option `lora`: [{"path", "scale"}], absolute paths in the record's order. Each is
loaded onto the model once (llama_adapter_lora_init; freed with the model), and its
scale is the one a request gets when it names none: the model's `scales`, which
POST /lora-adapters may change while it runs (llama-server's global scales).

A request's `lora: [{"id", "scale"}]` is llama-server's: `id` is the adapter's index
in that list, and an adapter it does not list, or lists without a scale, has scale 0
for that request. The scales a request decodes with are its `key`, a tuple of
(id, scale) for every adapter applied (scale 0 is not applied at all, so scale 0
gives the base model's reply exactly).

llama.cpp sets adapters on a whole context (llama_set_adapters_lora), and a batch
shares its context, so one decode step serves sequences of one key only
(localrt.engines.llama.batch takes the keys in turn), and a slot's cached KV, or a
saved state, serves only a prompt of the same key: KV computed under one adapter
is not the KV of another.
"""

from __future__ import annotations

import ctypes
import threading

from localrt.errors import InvalidField, shown


class Adapters:
    """The LoRA adapters loaded onto one llama.cpp model, their current scales, and
    which of them a context applies now. `_lock` guards `scales`; `_applied` is the
    decode step's alone (one step runs at a time)."""

    def __init__(self, llama_cpp, model, entries: list[dict] | None):
        self._ll = llama_cpp
        self.paths: list[str] = []
        self._handles: list = []
        for i, entry in enumerate(entries or ()):
            handle = llama_cpp.llama_adapter_lora_init(model, entry["path"].encode("utf-8"))
            if not handle:
                # llama.cpp's log says why (architecture, a tensor's shape); the ones
                # loaded already go with the model, which the caller closes.
                raise ValueError(f"llama.cpp could not load the LoRA adapter lora[{i}] "
                                 f"{entry['path']} onto the model")
            self._handles.append(handle)
            self.paths.append(entry["path"])
        self._lock = threading.Lock()
        self.scales = [float(e.get("scale", 1.0)) for e in entries or ()]
        self._applied: tuple | None = ()  # what the context applies: none when it is made

    def __len__(self) -> int:
        return len(self._handles)

    def listing(self) -> list[dict]:
        """GET /lora-adapters' rows: {"id", "path", "scale"}, the scale a request that
        names none decodes with."""
        with self._lock:
            scales = list(self.scales)
        return [{"id": i, "path": p, "scale": s}
                for i, (p, s) in enumerate(zip(self.paths, scales))]

    def set_scales(self, entries: list) -> None:
        """POST /lora-adapters: the scales of requests that name none, as llama-server
        sets them (an adapter the list leaves out: 0); a 400 naming an unknown id."""
        scales = self._scales(entries, "")
        with self._lock:
            self.scales = scales

    def key(self, lora: list | None) -> tuple:
        """The (id, scale) pairs a request decodes with: its `lora` (llama-server's: an
        adapter left out, or given no scale, is 0), or the model's scales when it has
        none; a 400 naming `lora[i].id` for an adapter the model does not have."""
        if lora is None:
            with self._lock:
                scales = list(self.scales)
        else:
            scales = self._scales(lora)
        return tuple((i, s) for i, s in enumerate(scales) if s != 0.0)

    def _scales(self, entries: list, field: str = "lora") -> list[float]:
        """Each adapter's scale as `entries` give them; a 400 naming `field[i].id` for
        an adapter the model does not have."""
        scales = [0.0] * len(self._handles)
        for i, entry in enumerate(entries):
            index = entry.get("id")
            if isinstance(index, float) and index.is_integer():  # JSON Schema's integer
                index = int(index)
            if not isinstance(index, int) or isinstance(index, bool) \
                    or not 0 <= index < len(scales):
                have = (f"its adapters are 0 to {len(scales) - 1}" if scales
                        else "it has no LoRA adapters")
                raise InvalidField(f"Invalid field '{field}[{i}].id': the model has no "
                                   f"adapter {shown(index)}; {have} (GET /lora-adapters "
                                   f"lists them)", param=f"{field}[{i}].id")
            scales[index] = float(entry.get("scale", 0.0))
        return scales

    def apply(self, ctx, key: tuple) -> None:
        """Make the context apply the adapters of `key` (only when it applies others)."""
        if key == self._applied:
            return
        n = len(key)
        handles = (self._ll.llama_adapter_lora_p_ctypes * n)(
            *[self._handles[i] for i, _ in key])
        scales = (ctypes.c_float * n)(*[s for _, s in key])
        self._applied = None  # unknown until llama.cpp says it took them
        if self._ll.llama_set_adapters_lora(ctx, handles if n else None, n,
                                            scales if n else None):
            raise RuntimeError("llama.cpp could not set the LoRA adapters on the context")
        self._applied = key

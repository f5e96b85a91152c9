"""Audio benchmark: a chat with a clip, and a transcription, through localrt against
llama-cpp-python's own mtmd path in this process, on the same pair and threads.

Run it from the repository root (not collected by pytest):

    .venv/bin/python tests/bench/bench_audio.py [--threads 1] [--samples 12] [--rtf-samples 5]

The pair is support.audio's "qwen2a" generator at a bench size (issue 36, item 8):

  * the audio projector has a Whisper-base sized encoder (80 mel bins, 6 blocks of
    width 512, 8 heads, feed-forward 2048; F32 as the generator writes it), so a
    30-second chunk costs what Whisper base's encoder costs, and its 750 tokens are
    projected to the text model's width. (Qwen2-Audio's real encoder is Whisper
    large-v3's, 1280 wide and 32 blocks: about 30 times this, minutes a run on a
    shared 2-core machine.)
  * the text model is ggufgen's llama of width 512, 4 blocks, feed-forward 1536, a
    2,048-token vocabulary (quantized to Q8_0 by llama.cpp), scripted: its blocks'
    weights are zero and it always writes the same 180 word pieces, then its end
    token, whatever the clip. A random model would write until its context is full;
    the script is a realistic transcript's length (a minute of speech is 150-200
    words) and both sides write exactly the same tokens. Zero weights cost what random
    ones do.

Both sides compute on --threads threads, 1 unless given: on a shared machine two
threads that meet at every operation spin while the other is descheduled, so a reply's
one-token steps vary several-fold from run to run, on both sides alike (measured on
this 2-core machine at a load of 5: the same 10 s transcription through localrt took
4.2 s with 3.6 CPU-seconds, then 23.3 s with 22.6; with one thread a 60 s one varied
7-13 s).

Each request gets a clip of its own (a tone whose pitch its seed picks, with noise),
on both sides, so no prompt cache helps either.

Rows:
1. Time to first token of a chat with a 10-second WAV clip (one 30-second mtmd chunk,
   750 audio tokens): localrt's non-streamed reply with max_tokens 1, from sending the
   request to its end, over HTTP to a `localrt start` child; against mtmd in this
   process on the same pair and threads (the WAV decoded by mtmd's helper,
   mtmd_tokenize, mtmd_helper_eval_chunks, the first token's argmax). --samples pairs
   of one request a side, which side goes first alternating from pair to pair, so a
   busy spell of a shared machine hits both; the median of each side, and of each
   pair's ratio. Target: localrt at least 0.95x the reference's speed (reference
   time / localrt time, the medians').
2. Real-time factor of a transcription of a 60-second WAV clip (three mtmd chunks):
   POST /v1/audio/transcriptions (response_format json) from sending the form to the
   reply's end, against the same chat through mtmd in this process (the clip, then
   "Transcribe the audio exactly.", as localrt renders it) decoded greedily to its end
   token. The RTF is seconds of work per second of audio (lower is better); the ratio
   is the reference's RTF / localrt's, target >= 0.95x as for row 1; --rtf-samples
   pairs, alternating as row 1's.
It prints a table (metric, localrt, reference, ratio, target, result) and exits 1 when
a row with a target fails. Only one side computes at a time.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import benchlib  # noqa: E402

MODEL_ID = "audio-bench"
CTX_LEN = 4096
QUESTION = "What is said in the clip?"
INSTRUCTION = "Transcribe the audio exactly."  # transcriptions.DEFAULT's, for qwen2a
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
SCRIPT = ["▁" + a + b for a in ALPHABET for b in ALPHABET][:180]  # the "transcript"
TARGET = 0.95


def make_pair(folder: Path) -> tuple[Path, Path]:
    from emulators.ggufgen import write_gguf
    from support.audio import write_audio_projector
    from support.models import quantize

    with benchlib.quiet_stderr():
        model = write_gguf(folder / "bench.gguf", name="bench", n_embd=512, n_layer=4,
                           n_head=8, n_ff=1536, vocab_size=2048,
                           context_length=CTX_LEN, script=SCRIPT)
        mmproj = write_audio_projector(folder / "mmproj-bench.gguf", n_embd=512,
                                       a_embd=512, a_head=8, a_ff=2048, a_layer=6,
                                       n_mel=80, fc_scale=0.05)
        return quantize(model, folder / "bench-Q8_0.gguf", "Q8_0"), mmproj


def clip(seconds: float, seed: int) -> bytes:
    from support.audio import wav

    return wav(seconds, seed)


class Reference:
    """The text model, a context and mtmd over them, in this process: llama-cpp-python's
    own mtmd path."""

    def __init__(self, model: Path, mmproj: Path, threads: int):
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.ll, self.mtmd = llama_cpp, mtmd_cpp
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(model).encode(), mparams)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_threads, cparams.n_threads_batch = CTX_LEN, threads, threads
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        p = mtmd_cpp.mtmd_context_params_default()
        p.n_threads, p.print_timings, p.use_gpu = threads, False, False
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.mctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), self.model, p)
        if not self.model or not self.ctx or not self.mctx:
            raise RuntimeError("llama.cpp could not load the pair")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.marker = mtmd_cpp.mtmd_default_marker().decode()

    def close(self) -> None:
        self.mtmd.mtmd_free(self.mctx)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)

    def run(self, prompt: str, data: bytes, max_tokens: int) -> int:
        """Decode the clip, read the prompt with it, and write up to `max_tokens` tokens
        greedily (to the end token); how many were written."""
        import numpy as np

        ll, mtmd = self.ll, self.mtmd
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.mctx, buf, len(data), False)
        text = prompt.encode()
        source = mtmd.mtmd_input_text(text, len(text), True, True)
        chunks = mtmd.mtmd_input_chunks_init()
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        try:
            if mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(source), bitmaps, 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            n_past = ll.llama_pos(0)
            if mtmd.mtmd_helper_eval_chunks(self.mctx, self.ctx, chunks, 0, 0, 512, True,
                                            ctypes.byref(n_past)) != 0:
                raise RuntimeError("mtmd_helper_eval_chunks failed")
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
        written = 0
        while True:
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1),
                                           shape=(self.n_vocab,))
            token = int(np.argmax(logits))
            if ll.llama_vocab_is_eog(self.vocab, token):
                return written
            written += 1
            if written >= max_tokens:
                return written
            one = (ll.llama_token * 1)(token)
            if ll.llama_decode(self.ctx, ll.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")


def chat_prompt(marker: str) -> str:
    """The rendered chat of an input_audio part after the question (ChatML)."""
    return f"<|im_start|>user\n{QUESTION}\n{marker}<|im_end|>\n<|im_start|>assistant\n"


def transcription_prompt(marker: str) -> str:
    """The rendered chat of a transcription: the clip, then the instruction."""
    return f"<|im_start|>user\n{marker}\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


def reference_ttft(ref: Reference, clips: list[bytes]) -> list[float]:
    times = []
    for data in clips:
        start = time.perf_counter()
        ref.run(chat_prompt(ref.marker), data, 1)
        times.append(time.perf_counter() - start)
    return times


def reference_transcribe(ref: Reference, clips: list[bytes]) -> list[tuple[float, int]]:
    out = []
    for data in clips:
        start = time.perf_counter()
        written = ref.run(transcription_prompt(ref.marker), data, CTX_LEN)
        out.append((time.perf_counter() - start, written))
    return out


def chat_body(data: bytes) -> dict:
    import base64

    return {"model": MODEL_ID, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(data).decode(), "format": "wav"}}]}]}


def localrt_ttft(port: int, clips: list[bytes]) -> list[float]:
    times = []
    for data in clips:
        body = chat_body(data)
        start = time.perf_counter()
        status, reply = benchlib.api(port, "POST", "/v1/chat/completions", body,
                                     timeout=600)
        times.append(time.perf_counter() - start)
        if status != 200:
            raise RuntimeError(f"chat answered {status}: {reply}")
    return times


def form(data: bytes) -> tuple[bytes, str]:
    """A transcription's multipart/form-data body and its Content-Type."""
    boundary = uuid.uuid4().hex
    fields = {"model": MODEL_ID, "response_format": "json"}
    out = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
           .encode() for k, v in fields.items()]
    out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
               f'filename="clip.wav"\r\nContent-Type: audio/wav\r\n\r\n'.encode()
               + data + f"\r\n--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


def localrt_transcribe(port: int, clips: list[bytes]) -> list[tuple[float, int]]:
    out = []
    for data in clips:
        body, ctype = form(data)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/v1/audio/transcriptions", body, {"Content-Type": ctype})
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        elapsed = time.perf_counter() - start
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"transcription answered {resp.status}: {reply}")
        out.append((elapsed, reply["usage"]["output_tokens"]))
    return out


def pairs(n: int, ref_side, our_side) -> tuple[list, list]:
    """`n` pairs of one reference sample and one localrt sample, the first in each
    pair alternating, so that a busy spell of a shared machine hits both sides."""
    theirs, ours = [], []
    for i in range(n):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            if side == 0:
                with benchlib.quiet_stderr():  # mtmd's helper logs each clip
                    theirs.append(ref_side(i))
            else:
                ours.append(our_side(i))
    return theirs, ours


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--samples", type=int, default=12, help="chat pairs")
    parser.add_argument("--rtf-samples", type=int, default=5, help="transcription pairs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("writing the pair ...", file=sys.stderr)
        model, mmproj = make_pair(root)
        print("writing the clips ...", file=sys.stderr)
        short = [clip(10.0, 100 + i) for i in range(2 * args.samples + 2)]
        long = [clip(60.0, 500 + i) for i in range(2 * args.rtf_samples)]
        proc, port = benchlib.start_server(root / "home", timeout=60)
        with benchlib.quiet_stderr():
            ref = Reference(model, mmproj, args.threads)
        try:
            status, body = benchlib.api(port, "POST", "/v1/models/import", {
                "path": str(model), "mmproj": str(mmproj), "id": MODEL_ID,
                "option": "symlink"})
            if status != 200:
                raise RuntimeError(f"import answered {status}: {body}")
            status, body = benchlib.api(port, "POST", f"/v1/models/{MODEL_ID}/start", {
                "ctx_len": CTX_LEN, "cpu_threads": args.threads, "flash_attn": True})
            if status != 200:
                raise RuntimeError(f"start answered {status}: {body}")
            # one warm-up a side (first encodes allocate their buffers)
            localrt_ttft(port, short[-1:])
            with benchlib.quiet_stderr():
                reference_ttft(ref, short[-2:-1])
            print(f"{args.samples} chat pairs ...", file=sys.stderr)
            raw, ours = pairs(args.samples,
                              lambda i: reference_ttft(ref, [short[2 * i]])[0],
                              lambda i: localrt_ttft(port, [short[2 * i + 1]])[0])
            print(f"{args.rtf_samples} transcription pairs ...", file=sys.stderr)
            raw_rtf, our_rtf = pairs(args.rtf_samples,
                                     lambda i: reference_transcribe(ref, [long[2 * i]])[0],
                                     lambda i: localrt_transcribe(port, [long[2 * i + 1]])[0])
        finally:
            ref.close()
            proc.terminate()
            proc.wait(timeout=30)
    raw_ms, our_ms = statistics.median(raw) * 1000, statistics.median(ours) * 1000
    ratio = raw_ms / our_ms
    raw_f = statistics.median(t for t, _ in raw_rtf) / 60
    our_f = statistics.median(t for t, _ in our_rtf) / 60
    rtf_ratio = raw_f / our_f
    print("chat TTFT pairs (ms, reference / localrt): " + ", ".join(
        f"{a * 1000:.0f}/{b * 1000:.0f}" for a, b in zip(raw, ours)))
    paired = statistics.median(a / b for a, b in zip(raw, ours))
    print(f"  each pair's ratio, median: {paired:.2f}x")
    print("transcription pairs (s and output tokens, reference / localrt): " + ", ".join(
        f"{a:.1f} ({k}) / {b:.1f} ({m})" for (a, k), (b, m) in zip(raw_rtf, our_rtf)))
    rows = [("metric", "localrt", "reference", "ratio", "target", "result"),
            ("TTFT, chat with a 10 s WAV clip (ms, median)", f"{our_ms:.1f}",
             f"{raw_ms:.1f}", f"{ratio:.2f}x", f">= {TARGET}x",
             "PASS" if ratio >= TARGET else "FAIL"),
            ("RTF, transcription of a 60 s WAV clip (median)", f"{our_f:.4f}",
             f"{raw_f:.4f}", f"{rtf_ratio:.2f}x", f">= {TARGET}x",
             "PASS" if rtf_ratio >= TARGET else "FAIL")]
    for r in rows:
        print(f"{r[0]:<48} {r[1]:>9} {r[2]:>10} {r[3]:>7} {r[4]:>9} {r[5]:>6}")
    return 1 if ratio < TARGET or rtf_ratio < TARGET else 0


if __name__ == "__main__":
    sys.exit(main())

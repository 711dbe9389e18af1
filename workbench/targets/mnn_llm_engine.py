"""The child process that holds MNN's LLM engine for ``mnn_llm.MnnLlm``; run as a script, not imported.

    python -P mnn_llm_engine.py FD      # FD: one end of a socket pair, a multiprocessing Connection

MNN's engine reads its folder with no bounds checks: a truncated weight file or a garbage graph is a
segfault, which in the workbench's own process would end a tree profile with nothing reported. Here a
crash ends this process only; the parent sees the connection close and says which folder it was.

It imports nothing of the workbench (that would import torch: seconds per start), only MNN, numpy and
the standard library. Requests are ``(op, args)``; each reply is ``("ok", result, seconds)`` with the
seconds the engine call took here (what the parent reports as the engine's time, without the pipe), or
``("error", message, 0.0)``. Arrays of logits follow their reply as raw bytes.
"""
from __future__ import annotations

import os
import sys
import time


def _peak_rss_mb() -> float | None:
    """This process's peak resident memory (VmHWM), MiB."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Engines:
    """Named engines (``step``: the last position's logits; ``score``: every position's), one resident at a time."""

    def __init__(self):
        import MNN.llm as llm  # noqa: F401  (imported once, before the baseline memory is read)
        self.llm = llm
        self.engines = {}
        self.baseline_mb = _peak_rss_mb()

    def load(self, config: str, threads: int, all_logits: bool, name: str):
        self.engines.clear()  # one engine's weights resident at a time
        m = self.llm.create(config)
        m.set_config({"thread_num": int(threads), "all_logits": bool(all_logits)})
        m.load()
        probe = m.forward([0])  # load() says nothing of failure; a graph that did not load gives no logits
        if probe is None or len(probe.shape) != 3:
            return False
        m.reset()
        self.engines[name] = m
        return True

    def forward(self, name: str, ids, reset: bool):
        import numpy as np
        m = self.engines[name]
        if reset:
            m.reset()
        out = m.forward([int(i) for i in ids])
        if out is None:
            raise RuntimeError("the engine gave no logits")
        a = np.array(out.read(), dtype=np.float32, copy=True)  # read() views the engine's buffer, reused next step
        return a.reshape(-1, a.shape[-1])

    def tokenizer_encode(self, name: str, text: str) -> list:
        return [int(i) for i in self.engines[name].tokenizer_encode(text)]

    def reset(self, name: str) -> None:
        self.engines[name].reset()

    def generate(self, name: str, prompt, new_tokens: int) -> dict:
        m = self.engines[name]
        m.reset()
        m._c_obj.generate_init()  # generate() alone adds to the counters (prefill_us, decode_us) of earlier calls
        m._c_obj.generate([int(i) for i in prompt], int(new_tokens))
        return self.context(name)

    def image_prompt(self, name: str, text: str, new_tokens: int):
        """A prompt with ``<img>PATH</img>`` read by the engine itself (its encoder, its 3-D positions): with
        ``new_tokens`` 0 the ids and every position's logits, else the engine's generate and its context."""
        import numpy as np
        m = self.engines[name]
        m.reset()  # also zeroes vision_us
        ids = [int(i) for i in m.tokenizer_encode(text)]
        try:
            if new_tokens:
                m._c_obj.generate_init()
                m._c_obj.generate(ids, int(new_tokens))
                return {"ids": ids, "tokens": [int(t) for t in m.context.output_tokens], **self.context(name)}
            out = m.forward(ids)
            if out is None:
                raise RuntimeError("the engine gave no logits")
            return {"ids": ids, "logits": np.array(out.read(), dtype=np.float32, copy=True).reshape(len(ids), -1)}
        finally:
            m.tokenizer_encode("")  # the picture's positions are kept until the next encode: text prompts get their own

    def image_start(self, name: str, text: str):
        """The first step of a generation with a picture: the engine reads it from ``text`` and prefills through
        its KV cache (``forward`` steps follow); the ids and the last position's logits."""
        import numpy as np
        m = self.engines[name]
        m.reset()
        ids = [int(i) for i in m.tokenizer_encode(text)]
        out = m.forward(ids)
        m.tokenizer_encode("")  # later steps take the engine's decode positions, as its own generate does
        if out is None:
            raise RuntimeError("the engine gave no logits")
        a = np.array(out.read(), dtype=np.float32, copy=True)
        return {"ids": ids, "logits": a.reshape(-1, a.shape[-1])[-1]}

    def context(self, name: str) -> dict:
        ctx = self.engines[name].context
        return {k: getattr(ctx, k) for k in ("prompt_len", "gen_seq_len", "prefill_us", "decode_us", "vision_us")
                if isinstance(getattr(ctx, k, None), (int, float))}

    def peak_rss_added_mb(self) -> float | None:
        now = _peak_rss_mb()
        return None if now is None or self.baseline_mb is None else now - self.baseline_mb


def serve(conn) -> None:
    """Answer requests until ``close`` or the parent goes away."""
    import numpy as np
    try:
        engines = Engines()
    except Exception as e:  # MNN missing or broken: said once, then this process ends
        conn.send(("error", f"{type(e).__name__}: {e}", 0.0))
        return
    conn.send(("ok", "ready", 0.0))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            return
        try:
            t = time.perf_counter()
            result = getattr(engines, op)(*args)
            seconds = time.perf_counter() - t
        except Exception as e:  # a Python-level failure of the engine: the parent turns it into one line
            conn.send(("error", f"{type(e).__name__}: {e}", 0.0))
            continue
        if isinstance(result, np.ndarray):
            conn.send(("ok", ("array", result.shape), seconds))
            conn.send_bytes(memoryview(np.ascontiguousarray(result)).cast("B"))
        else:
            conn.send(("ok", result, seconds))


def main(argv) -> int:
    from multiprocessing.connection import Connection
    conn = Connection(int(argv[1]))
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # MNN prints from C++ (CPU features, load messages): none of it is the parent's output
    serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

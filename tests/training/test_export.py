"""From training to answers: `rag export CKPT DIR`, model.export_dir at the end of `rag fit`, `rag predict` writing
predictions with provenance, `rag test` printing samples, `rag -v test`, and the clear errors around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml


def _fit(root: Path, models: tuple, *, seed: int, steps: int, module: dict, data: dict) -> str:
    """`rag fit` on the tiny models with a frozen query encoder, checkpoints in root/ckpt; returns the config path."""
    from rag.cli import main

    generator, question_encoder, kb = models
    cfg = {
        "seed_everything": seed,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": steps, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                    "default_root_dir": str(root / "run"), "enable_progress_bar": False, "logger": False,
                    "callbacks": [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(root / "ckpt"), "save_last": True}}]},
        "model": {"class_path": "RagModule", "init_args": {
            "generator": generator, "question_encoder": question_encoder, "knowledge_base": kb,
            "rag": {"n_docs": 2, "max_context_length": 48, "max_target_length": 8, "freeze_query_encoder": True},
            "export_dir": str(root / "exported"), **module}},
        "data": {"class_path": "QADataModule", "init_args": {"train": "demo:train", "batch_size": 4, "max_eval_examples": 4,
                                                             **data}},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    assert main(["fit", "--config", str(path)]) == 0
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir) -> dict:
    """A 2-step `rag fit` on the tiny models with a frozen query encoder, a checkpoint and an export at the end."""
    root = tmp_path_factory.mktemp("export_run")
    path = _fit(root, (tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir), seed=7, steps=2,
                module={"decoding": {"max_new_tokens": 3, "sequence_decoding": "fast"}, "evaluation": {"recall_at": [1, 2]}},
                data={"test": "demo:test", "predict": "demo:test"})
    return {"root": root, "config": path, "ckpt": root / "ckpt" / "last.ckpt", "exported": root / "exported"}


QUESTIONS = ["what is the chemical symbol of argon?", "which element has atomic number 18?"]


def _answers(model_dir) -> list[str]:
    import rag

    return [a.text for a in rag.load(model_dir).generate(QUESTIONS, max_new_tokens=3)]


def test_fit_exports_and_rag_export_writes_the_same_model(run, tmp_path, capsys):
    from rag.cli import main

    assert (run["exported"] / "rag_config.json").is_file()
    out = tmp_path / "from_ckpt"
    assert main(["export", str(run["ckpt"]), str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    meta = json.loads((out / "rag_config.json").read_text())
    assert not (out / "question_encoder").exists()  # the unchanged query encoder is referenced, not copied
    assert json.dumps(meta).count('"reference": true') == 1
    assert _answers(out) == _answers(run["exported"])  # the checkpoint and the end-of-fit export are one model
    assert main(["generate", "--model", str(out), "--json", QUESTIONS[0], "--max-new-tokens", "3"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["question"] == QUESTIONS[0] and row["passages"]


def test_export_refuses_what_it_must_not_touch(run, tmp_path, capsys):
    from rag.cli import main

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    assert main(["export", str(run["ckpt"]), str(busy)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(run["ckpt"]), str(busy), "--overwrite"]) == 2  # not an export: never replaced
    assert (busy / "notes.txt").read_text() == "keep me"
    assert main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "o")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    assert main(["export", str(garbage), str(tmp_path / "o")]) == 2
    assert "cannot be read as a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_generate_with_a_checkpoint_file_says_export(run, capsys):
    from rag.cli import main

    assert main(["generate", "--model", str(run["ckpt"]), "q?"]) == 2
    err = capsys.readouterr().err
    assert "Lightning checkpoint" in err and f"rag export {run['ckpt']} DIR" in err


def test_predict_writes_jsonl_with_provenance_and_test_prints_samples(run, capsys, tmp_path):
    from rag.cli import main

    assert main(["predict", "--config", run["config"], "--ckpt_path", str(run["ckpt"])]) == 0
    out = capsys.readouterr().out
    path = Path(run["root"]) / "run" / "predictions.jsonl"
    assert f"wrote 4 predictions to {path}" in out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and all(r["kb_version"] and len(r["passages"]) == 2 and r["answers"] for r in rows)
    assert {"id", "title", "score"} == set(rows[0]["passages"][0])
    assert main(["-v", "test", "--config", run["config"], "--ckpt_path", str(run["ckpt"])]) == 0
    assert "test samples:" in capsys.readouterr().out
    assert main(["predict", "--config", run["config"], "--ckpt_path", str(run["ckpt"]), "--data.predict", "null"]) == 2
    assert "data.predict" in capsys.readouterr().err


@pytest.fixture(scope="module")
def beam_run(tmp_path_factory, tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir) -> dict:
    """A 1-step `rag fit` scored with 4 beams and length penalty 2: the exported model stores those settings."""
    from rag.cli import main

    root = tmp_path_factory.mktemp("beam_run")
    path = _fit(root, (tiny_bart_dir, tiny_dpr_question_dir, tiny_kb_dir), seed=3, steps=1,
                module={"decoding": {"num_beams": 4, "length_penalty": 2.0, "max_new_tokens": 4, "sequence_decoding": "fast"},
                        "evaluation": {"recall_at": [1], "predictions_file": str(root / "predictions.jsonl")}},
                data={"predict": "demo:test"})
    # `rag predict` decodes as `rag test` scores (RagModule.decoding_defaults)
    assert main(["predict", "--config", path, "--ckpt_path", str(root / "ckpt" / "last.ckpt")]) == 0
    predictions = [json.loads(line) for line in (root / "predictions.jsonl").read_text().splitlines()]
    return {"exported": root / "exported", "predictions": predictions}


def test_exported_decoding_settings_apply_on_every_path(beam_run, monkeypatch, capsys):
    """A model exported with num_beams 4 / length_penalty 2 answers alike through `rag generate --model DIR`,
    rag.load(DIR).generate and POST /generate: no path substitutes its own defaults for the stored ones."""
    import httpx

    import rag
    from rag.cli import main
    from rag.generation.search import GenerationConfig
    from rag.pipeline import readers
    from rag.serve.app import ServeLimits, background_server, create_app

    seen: list[GenerationConfig] = []
    original = readers.RagReader._generation_config

    def spy(self, *a, **kw):
        config = original(self, *a, **kw)
        seen.append(config)
        return config

    monkeypatch.setattr(readers.RagReader, "_generation_config", spy)
    model_dir = str(beam_run["exported"])
    questions = [p["question"] for p in beam_run["predictions"]]
    scored = [p["answer"] for p in beam_run["predictions"]]
    stored = json.loads((beam_run["exported"] / "rag_config.json").read_text())
    assert stored["config"]["generation"] == {"num_beams": 4, "max_new_tokens": 4, "length_penalty": 2.0}

    assert main(["generate", "--model", model_dir, "--json", *questions]) == 0
    by_cli = [json.loads(line)["text"] for line in capsys.readouterr().out.strip().splitlines()]
    pipe = rag.load(model_dir)
    by_api = [a.text for a in pipe.generate(questions)]
    app = create_app(pipe, limits=ServeLimits(request_timeout=None))
    with background_server(app) as url:
        resp = httpx.post(f"{url}/generate", json={"questions": questions}, timeout=120)
    assert resp.status_code == 200, resp.text
    by_http = [a["text"] for a in resp.json()["answers"]]
    assert by_cli == by_api == by_http == scored
    assert len(seen) >= 3 and all((c.num_beams, c.length_penalty, c.max_new_tokens) == (4, 2.0, 4) for c in seen)
    # an explicit option still wins over the stored one
    seen.clear()
    assert main(["generate", "--model", model_dir, "--num-beams", "2", QUESTIONS[0]]) == 0
    assert seen[0].num_beams == 2 and seen[0].length_penalty == 2.0


def _page_defaults() -> dict:
    """``{id: value}`` of the web page's form fields as it loads (an input's value attribute, a select's selected
    option), read from rag/serve/static/index.html."""
    from html.parser import HTMLParser
    from importlib import resources

    html = resources.files("rag.serve").joinpath("static", "index.html").read_text()
    values: dict = {}

    class Fields(HTMLParser):
        select = None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "input" and "id" in a:
                values[a["id"]] = a.get("value") or ""
            elif tag == "select":
                self.select = a["id"]
            elif tag == "option" and self.select and (self.select not in values or "selected" in a):
                values[self.select] = a.get("value") or ""

        def handle_endtag(self, tag):
            if tag == "select":
                self.select = None

    Fields().feed(html)
    return values


def _page_request(question: str, defaults: dict):
    """The body the page's own request builder (``request`` in rag/serve/static/app.js) sends for `question` with the
    form as it loads, run with node over a stub document; None without node."""
    import shutil
    import subprocess
    from importlib import resources

    node = shutil.which("node")
    if node is None:
        return None
    script = resources.files("rag.serve").joinpath("static", "app.js")
    harness = ("const values = JSON.parse(process.argv[1]);"
               "const element = (id) => ({ value: values[id] === undefined ? '' : values[id], addEventListener() {},"
               "  classList: { toggle() {}, add() {}, remove() {} } });"
               "global.window = global; global.document = { getElementById: element, addEventListener() {},"
               "  body: { classList: { toggle() {} } } };"
               f"require({json.dumps(str(script))});"
               f"process.stdout.write(JSON.stringify(window.ragPageRequest({json.dumps(question)})));")
    out = subprocess.run([node, "-e", harness, json.dumps(defaults)], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_what_the_page_sends_leaves_the_stored_decoding_settings_in_force(beam_run, monkeypatch):
    """The web page is a fourth path: as it loads, its form sets no generation option (no marginalization, no token
    count), and the body its request builder sends for a question is {"questions": [...]} alone, which POST /generate
    answers with the model's stored settings (num_beams 4, length_penalty 2, max_new_tokens 4) and its scored answers.
    (Chromium drives the page itself in tests/serve/test_serve_page.py.)"""
    import httpx

    import rag
    from rag.generation.search import GenerationConfig
    from rag.pipeline import readers
    from rag.serve.app import ServeLimits, background_server, create_app

    defaults = _page_defaults()
    options = {"n-docs", "marginalization", "ensemble", "max-new-tokens", "min-new-tokens", "num-beams"}
    assert options <= set(defaults)
    assert {k: v for k, v in defaults.items() if k in options and v} == {}  # the form as it loads sets nothing
    question = beam_run["predictions"][0]["question"]
    body = _page_request(question, defaults)
    if body is not None:
        assert body == {"questions": [question]}
    else:  # no node: the body the builder sends when every field is empty
        body = {"questions": [question]}
    seen: list[GenerationConfig] = []
    original = readers.RagReader._generation_config

    def spy(self, *a, **kw):
        config = original(self, *a, **kw)
        seen.append(config)
        return config

    monkeypatch.setattr(readers.RagReader, "_generation_config", spy)
    app = create_app(rag.load(str(beam_run["exported"])), limits=ServeLimits(request_timeout=None))
    with background_server(app) as url:
        resp = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert [a["text"] for a in resp.json()["answers"]] == [beam_run["predictions"][0]["answer"]]
    assert seen and all((c.num_beams, c.length_penalty, c.max_new_tokens) == (4, 2.0, 4) for c in seen)


def test_a_checkpoint_of_an_earlier_release_exports_the_same_model(run, tmp_path, capsys):
    """`rag export` of a checkpoint whose hyperparameters are the flat options of an earlier release (generator_lr,
    max_new_tokens, recall_at, ...): they are read into today's groups, and the export answers as the current one."""
    import torch

    from rag.cli import main
    from rag.training.settings import RENAMED

    ckpt = torch.load(run["ckpt"], map_location="cpu", weights_only=True)
    hp = dict(ckpt["hyper_parameters"])
    flat = {}
    for old, new in RENAMED["RagModule"].items():
        group, name = new.split(".")
        if isinstance(hp.get(group), dict) and name in hp[group]:
            flat[old] = hp[group][name]
    for group in ("optimizer", "decoding", "evaluation"):
        hp.pop(group)
    hp["retrieval_actors"] = hp.pop("retrieval_actors")["count"]
    ckpt["hyper_parameters"] = {**hp, **flat, "build_knowledge_base_from": None}
    assert "max_new_tokens" in flat and "recall_at" in flat and "generator_lr" in flat
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    assert main(["export", str(old), str(tmp_path / "out")]) == 0
    capsys.readouterr()
    stored = json.loads((tmp_path / "out" / "rag_config.json").read_text())["config"]["generation"]
    assert stored == json.loads((run["exported"] / "rag_config.json").read_text())["config"]["generation"]
    assert _answers(tmp_path / "out") == _answers(run["exported"])

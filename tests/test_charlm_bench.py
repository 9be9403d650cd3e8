"""The charlm task, k_ratio / stage telemetry, --dump-grads and `gradsift bench select`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradsift.cli import main
from gradsift.runtime.runconfig import RunConfig
from gradsift.runtime.simulate import Simulator
from gradsift.tasks import TaskError, make_task


def shakespeare(shared_dir):
    p = shared_dir / "data" / "tinyshakespeare.txt"
    if not p.exists():
        pytest.skip(f"{p} is not beside the project")
    return str(p)


SMALL = {"hidden": 32, "embed": 16, "seq_len": 32, "eval_chars": 2048, "max_chars": 200_000}


def test_charlm_needs_data(tmp_path, capsys):
    with pytest.raises(TaskError):
        make_task("charlm", 2)
    rc = main(["train", "--task", "charlm", "--compressor", "topk", "--steps", "1", "--out", str(tmp_path / "x"), "--quiet"])
    assert rc == 2
    assert "--data" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    assert main(["train", "--task", "charlm", "--compressor", "topk", "--data", str(bad), "--steps", "1", "--out", str(tmp_path / "y"),
                 "--quiet"]) == 2


def test_charlm_trains_and_reports_perplexity(shared_dir):
    data = shakespeare(shared_dir)
    task = make_task("charlm", 3, data=data, **SMALL)
    assert len(task.vocab) > 30
    cfg = RunConfig(task="charlm", compressor="sidco", ratio=0.05, workers=3, steps=12, data=data, lr=1.0,
                    task_options=SMALL, eval_every=12)
    recs = Simulator(cfg).run()
    first_ppl = math.exp(recs[0]["loss"])
    assert recs[-1]["perplexity"] < len(task.vocab)  # better than uniform
    assert recs[-1]["loss"] < math.log(first_ppl)
    assert all("k_ratio" in r and "sidco_stages" in r for r in recs)


def test_dump_grads_and_bench_on_them(tmp_path, shared_dir):
    dump = tmp_path / "grads.pt"
    rc = main(["train", "--task", "digits-mlp", "--compressor", "topk", "--workers", "2", "--steps", "3",
               "--dump-grads", str(dump), "--out", str(tmp_path / "run"), "--quiet"])
    assert rc == 0
    g = torch.load(dump)
    assert g.shape[0] == 3 and g.dtype == torch.float32 and g.shape[1] == 64 * 64 + 64 + 64 * 10 + 10
    out = tmp_path / "bench"
    rc = main(["bench", "select", "--compressors", "topk", "sidco", "dgc", "--sizes", "5000", "20000",
               "--ratios", "0.1", "0.01", "--dist", str(dump), "--calls", "6", "--out", str(out), "--quiet",
               "--threads", "1"])
    assert rc == 0
    recs = json.loads((out / "bench.json").read_text())
    assert len(recs) == 3 * 2 * 2
    need = {"compressor", "size", "ratio", "dist", "median_s", "min_s", "max_s", "vs_topk", "vs_topk_range", "vs_dgc",
            "read_passes", "k_ratio", "threads", "backend", "busy", "device"}
    for r in recs:
        assert need <= set(r)
        assert r["dist"] == str(dump) and r["threads"] == 1 and r["backend"] in ("compiled", "eager") and r["device"] == "cpu"
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["vs_topk_range"][0] <= r["vs_topk"] <= r["vs_topk_range"][1]
    topk = [r for r in recs if r["compressor"] == "topk"]
    assert all(r["k_ratio"] == 1.0 for r in topk)
    assert (out / "bench.md").read_text().count("| `") == 12
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_synthetic_and_errors(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench", "select", "--compressors", "gaussiank", "--sizes", "10000", "--ratios", "0.01",
                 "--dist", "student-t", "--calls", "4", "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "bench.json").read_text())[0]["dist"] == "student-t"
    assert main(["bench", "select", "--compressors", "topk", "--dist", "nope", "--sizes", "100",
                 "--out", str(out), "--quiet"]) == 2
    assert main(["bench", "select", "--compressors", "topk", "--ratios", "2", "--out", str(out), "--quiet"]) == 2
    assert main(["bench", "select", "--compressors", "nope", "--sizes", "100", "--out", str(out), "--quiet"]) == 2
    assert main(["bench", "select", "--compressors", "topk", "--threads", "0", "--out", str(out), "--quiet"]) == 2
    expect = 4
    if not torch.cuda.is_available():
        assert main(["bench", "select", "--compressors", "topk", "--device", "cuda", "--out", str(out), "--quiet"]) == 2
        expect += 1
    err = [l for l in capsys.readouterr().err.strip().splitlines() if "warning" not in l]
    assert len(err) == expect
    if expect == 5:
        assert err[-1] == "gradsift bench select: --device cuda needs a CUDA GPU, and torch sees none here"


def test_bench_select_over_a_models_layers(tmp_path, capsys):
    """--model builds the published shapes (counts checked against the papers' parameter totals); --shapes times a
    JSON file's; every method's step is reported against one read pass of every tensor; bad input is one line."""
    from gradsift.experiments.model_bench import MODELS

    totals = {name: (len(f()), sum(math.prod(s) for _, s in f())) for name, f in MODELS.items()}
    assert totals == {"resnet50": (161, 25557032), "bert-base": (199, 109482240), "gpt2-small": (148, 124439808),
                      "vit-b16": (152, 86567656)}  # (torchvision's vit_b_16: 86,567,656)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([["emb", [500, 16]], [64, 3, 3, 3], [64]]))
    out = tmp_path / "model"
    assert main(["bench", "select", "--compressors", "topk", "randomk", "--shapes", str(shapes), "--ratios", "0.01",
                 "--calls", "4", "--out", str(out), "--quiet"]) == 0
    recs = json.loads((out / "bench.json").read_text())
    assert [r["compressor"] for r in recs] == ["topk", "randomk"] and recs[0]["tensors"] == 3
    assert all(r["read_passes"] > 0 and r["memory"] == "ef" for r in recs)
    assert (out / "bench.md").read_text().count("| 0.01 | `") == 2
    capsys.readouterr()
    assert main(["bench", "select", "--compressors", "topk", "--model", "vgg", "--out", str(tmp_path / "x"),
                 "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("gradsift bench select: --model must be one of")

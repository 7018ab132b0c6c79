"""Hugging Face models, BPE tokenizers, records data, export and sample.

A byte-level BPE tokenizer is trained here on a slice of the embedded stdlib corpus (the real
``p2pdiloco tokenizer train``) and a JSONL file written here; a 2-layer Llama is then trained by a
bootstrap peer and two volunteers through the real CLI:

* streaming fragments (2) with the 4-bit e3m0 codec: identical digests after every sync, validation
  loss falls; peers with another HF config or another tokenizer are refused naming the field;
  ``export`` then ``AutoModelForCausalLM.from_pretrained`` gives the run's global logits (< 1e-5);
  ``sample`` prints a continuation;
* one fragment, fp32: the global parameters equal test_swarm's single-process reference within 1e-6.

Plus the built-in GPT's export (as GPT2LMHeadModel), the exact initialisation, the layer-wise
fragments, and the bad inputs (one line each).
"""
from __future__ import annotations

import json
import os
import subprocess
import sysconfig

import pytest
import torch

from conftest import ROOT, TINY, cli_argv
from p2pdiloco.config import load_config
from p2pdiloco.data import BatchStream, DataConfig, load_corpus
from p2pdiloco.errors import ConfigError
from p2pdiloco.metrics import read_metrics
from p2pdiloco.run_identity import fingerprint_fields
from test_swarm import reference_diloco

VOCAB = 512
H, P = 8, 2


def _llama(assets, *extra):
    return ["model.kind=hf", "model.hf_config=llama", f"model.vocab_size={VOCAB}", "model.d_model=64",
            "model.n_layers=2", "model.n_heads=4", "model.seq_len=64", "model.hf_kv_heads=2",
            f"data.tokenizer={assets}/tok.json", f"data.source={assets}/data.jsonl", f"data.cache_dir={assets}/cache",
            "data.num_shards=2", "data.val_fraction=0.1", f"inner.sync_every={H}", "inner.batch_size=4",
            "inner.warmup_steps=4", "train.progress_bar=false", "swarm.min_peers_to_start=2", *extra]


def _sets(settings):
    return sum((["--set", s] for s in settings), [])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """tok.json (BPE trained by the CLI on 200 kB of the stdlib corpus), tok2.json (another one of the
    same size, in process) and data.jsonl (stdlib source in records of <= 1500 characters)."""
    d = tmp_path_factory.mktemp("hf")
    r = subprocess.run(cli_argv("tokenizer", "train", "--data", "stdlib", "--vocab-size", str(VOCAB), "--out",
                                str(d / "tok.json"), "--max-bytes", "200000"), capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{VOCAB} ids" in r.stdout
    from p2pdiloco.data import DataConfig
    from p2pdiloco.tokenized import iter_training_text
    from p2pdiloco.tokenizer import train_bpe

    assert train_bpe(iter_training_text(DataConfig(max_bytes=150_000)), VOCAB, str(d / "tok2.json")) == VOCAB
    root = sysconfig.get_paths()["stdlib"]
    with open(d / "data.jsonl", "w") as f:
        for name in sorted(n for n in os.listdir(root) if n.endswith(".py"))[:50]:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as src:
                text = src.read()[:15000]
            for i in range(0, len(text), 1500):
                f.write(json.dumps({"text": text[i:i + 1500], "path": name}) + "\n")
    return d


def _run_pair(procs, tmp_path, settings, run_id):
    addr = procs.bootstrap()
    peers = []
    for i in range(2):
        peers.append(procs.start("join", "--initial-peers", addr, "--config", TINY,
                                 *_sets(settings + [f"swarm.run_id={run_id}", f"data.shard={i}",
                                                    f"train.run_dir={tmp_path}/p{i}"]), name=f"p{i}"))
    for p in peers:
        assert procs.wait(p, 150) == 0, procs.err(p.name)[-3000:]
    starts, syncs, summaries = {}, {}, {}
    for i in range(2):
        recs = read_metrics(str(tmp_path / f"p{i}" / "metrics.jsonl"))
        starts[i] = [r for r in recs if r["event"] == "start"][0]
        syncs[i] = [r for r in recs if r["event"] == "sync"]
        summaries[i] = [r for r in recs if r["event"] == "summary"][0]
        assert syncs[i] and all(r["ok"] and r["group_size"] == 2 for r in syncs[i]), syncs[i]
    assert len(syncs[0]) == len(syncs[1])
    for k in range(len(syncs[0])):
        assert syncs[0][k]["digest"] == syncs[1][k]["digest"], f"peers disagree after sync {k}"
    return addr, starts, syncs, summaries


@pytest.mark.timeout(200)
def test_llama_swarm_streaming_4bit_export_sample(procs, tmp_path, assets):
    settings = _llama(assets, f"streaming.fragments={P}", "streaming.pattern=balanced", "compression.codec=e3m0",
                      "train.max_outer_steps=3")
    addr, starts, syncs, summaries = _run_pair(procs, tmp_path, settings, "hf4")
    assert [(r["fragment"], r["step"]) for r in syncs[0]] == [(0, 8), (1, 12), (0, 16), (1, 20), (0, 24)]
    assert "blocks [0]; other ['lm.model.embed_tokens.weight']" in procs.err("p0")  # split by decoder layer
    for i in range(2):
        assert summaries[i]["val_loss_end"] < summaries[i]["val_loss_start"] - 0.3, summaries[i]

    # peers with another HF config or another tokenizer (same vocabulary size) are refused, naming the field
    bad = {"badcfg": settings + ["model.hf_intermediate_size=128"],
           "badtok": [s.replace("tok.json", "tok2.json") for s in settings]}
    started = {name: procs.start("join", "--initial-peers", addr, "--config", TINY,
                                 *_sets(s + ["swarm.run_id=hf4", f"train.run_dir={tmp_path}/{name}"]), name=name)
               for name, s in bad.items()}
    # meanwhile, export (the swarm's global copy as a HF model dir) and sample
    out = tmp_path / "export"
    ex = procs.start("export", "--run-dir", str(tmp_path / "p0"), "--out", str(out), name="export")
    sm = procs.start("sample", "--run-dir", str(tmp_path / "p0"), "--prompt", "def ", "--max-new-tokens", "12",
                     name="sample")
    for name, field in (("badcfg", "model.hf.intermediate_size: run has 256, you have 128"),
                        ("badtok", "data.vocab: run has 'bpe-512-")):
        assert procs.wait(started[name], 90) == 2
        err = procs.err(name)
        assert field in err and "Traceback" not in err, err[-2000:]

    assert procs.wait(ex, 90) == 0, procs.err("export")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from p2pdiloco.export import load_run

    cfg, model, _ = load_run(str(tmp_path / "p0"))
    ckpt = torch.load(tmp_path / "p0" / "checkpoint.pt", weights_only=True)
    named = dict(model.named_parameters())
    from p2pdiloco.diloco.fragments import split_fragments

    for names, o in zip(split_fragments(model, P, "balanced").names, ckpt["outer"]):  # global, not the inner copy
        assert all(torch.equal(named[n], t) for n, t in zip(names, o["params"]))
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tok.encode("def main(argv):\n    return 0\n")])
    with torch.no_grad():
        diff = float((hf(ids).logits - model(ids)[0]).abs().max())
    assert diff < 1e-5, diff
    assert procs.wait(sm, 60) == 0, procs.err("sample")
    assert procs.out("sample").startswith("def ") and len(procs.out("sample")) > 6


@pytest.mark.timeout(200)
def test_llama_swarm_fp32_matches_reference(procs, tmp_path, assets):
    settings = _llama(assets, "compression.codec=fp32", "train.max_outer_steps=2")
    _, starts, syncs, _ = _run_pair(procs, tmp_path, settings, "hf32")
    assert [r["outer_step"] for r in syncs[0]] == [1, 2]
    cfg = load_config(TINY, settings)
    order = sorted(range(2), key=lambda i: starts[i]["peer"])
    ref = reference_diloco(cfg, [starts[i]["shard"] for i in order], 2)
    ckpt = torch.load(tmp_path / "p0" / "checkpoint.pt", weights_only=True)
    ref_params = [p.detach() for p in ref.parameters()]
    worst = max(float((a - b).abs().max()) for a, b in zip(ckpt["outer"][0]["params"], ref_params, strict=True))
    assert worst < 1e-6, f"swarm differs from the single-process reference by {worst}"


@pytest.mark.timeout(120)
def test_gpt_export_as_gpt2(tmp_path):
    """The built-in GPT exports as a standard GPT2LMHeadModel with the byte vocabulary (id = byte). The
    run folder is made here (run_config.json as join writes it, a checkpoint whose global copy differs
    from its inner model) to keep the test short; the Llama test above goes through join."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from p2pdiloco.checkpoint import save_checkpoint
    from p2pdiloco.export import export_run, load_run
    from p2pdiloco.model import build_model

    cfg = load_config(TINY, ["data.max_bytes=300000", "model.tie_embeddings=false", "streaming.fragments=2",
                             "inner.sync_every=4"])
    run = tmp_path / "g"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps(cfg.to_dict()))  # as join writes it (train.replica.save_run_config)
    torch.manual_seed(3)
    trained = build_model(cfg.model)
    from p2pdiloco.diloco.fragments import split_fragments

    named = dict(trained.named_parameters())
    outer = [{"params": [named[n].detach().clone() for n in names], "buffers": [torch.zeros_like(named[n]) for n in names],
              "steps": 1} for names in split_fragments(trained, 2).names]
    save_checkpoint(str(run), {"format": 1, "outer": outer, "model": {}})
    assert "GPT2LMHeadModel" in export_run(str(run), str(tmp_path / "out"))
    _, model, _ = load_run(str(run))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained.parameters()))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    text = "def f(x):\n    return x  # é"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text  # id = byte
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert float((hf(ids).logits - model(ids)[0]).abs().max()) < 1e-5


def test_hf_init_exact_and_layerwise_fragments(assets, tmp_path):
    from p2pdiloco.diloco.fragments import split_fragments
    from p2pdiloco.model import build_model

    cfg = load_config(TINY, _llama(assets, "model.n_layers=4"))
    torch.manual_seed(0)
    a = build_model(cfg.model)
    torch.manual_seed(0)
    b = build_model(cfg.model)
    torch.manual_seed(1)
    c = build_model(cfg.model)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and not torch.equal(sa["lm.model.embed_tokens.weight"],
                                                                        sc["lm.model.embed_tokens.weight"])
    assert torch.equal(sa["lm.model.norm.weight"], torch.ones(64))
    assert a.lm.lm_head.weight is a.lm.model.embed_tokens.weight  # tied: one parameter
    layout = split_fragments(a, 2, "strided")
    blocks = [sorted({int(n.split(".")[3]) for n in names if ".layers." in n}) for names in layout.names]
    assert blocks == [[0, 2], [1, 3]]
    assert layout.names[0][0] == "lm.model.embed_tokens.weight" and layout.names[1][-1] == "lm.model.norm.weight"
    seq = split_fragments(a, 2, "sequential")
    assert [sorted({int(n.split(".")[3]) for n in names if ".layers." in n}) for names in seq.names] == [[0, 1], [2, 3]]
    # balanced: runs of consecutive layers, the embedding weighing on the first; the largest run is smallest
    bal, strided3 = split_fragments(a, 3, "balanced"), split_fragments(a, 3, "strided")
    assert [sorted({int(n.split(".")[3]) for n in names if ".layers." in n}) for names in bal.names] == [[0], [1, 2], [3]]
    assert bal.names[0][0] == "lm.model.embed_tokens.weight" and max(bal.numels) < max(strided3.numels)
    assert sum(bal.numels) == sum(p.numel() for p in a.parameters())
    # the fingerprint holds the resolved transformers config, field by field
    fields = fingerprint_fields(cfg)
    assert fields["model.hf.num_key_value_heads"] == 2 and fields["data.vocab"].startswith(f"bpe-{VOCAB}-")

    # model.init_from: a local model directory's weights replace the random start; their hash is fingerprinted
    a.lm.save_pretrained(str(tmp_path / "pre"))
    pre = load_config(TINY, _llama(assets, "model.n_layers=4", f"model.init_from={tmp_path}/pre", "train.seed=5"))
    torch.manual_seed(5)
    d = build_model(pre.model).state_dict()
    assert all(torch.equal(sa[k], d[k]) for k in sa)
    assert fingerprint_fields(pre)["model.init_from"].startswith("sha256:") and fields["model.init_from"] == ""
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight has shape \(512, 64\), the model \(512, 32\)"):
        build_model(load_config(TINY, _llama(assets, "model.n_layers=4", "model.d_model=32",
                                             f"model.init_from={tmp_path}/pre")).model)


def test_bad_inputs_one_line(assets, tmp_path):
    def err(**kw) -> str:
        kw.setdefault("cache_dir", str(tmp_path / "cache"))
        with pytest.raises(ConfigError) as e:
            load_corpus(DataConfig(**kw))
        assert "\n" not in str(e.value)
        return str(e.value)

    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    assert "has no field 'text'" in err(source=str(tmp_path / "other.jsonl")) and "body" in err(
        source=str(tmp_path / "other.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    assert "cannot read" in err(source=str(tmp_path / "broken.jsonl"))
    assert "matches no file" in err(source=str(tmp_path / "nothing-*.jsonl"))
    (tmp_path / "d.jsonl").mkdir()
    assert "matches no file" in err(source=str(tmp_path / "d.jsonl"))
    (tmp_path / "num.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    assert "not text" in err(source=str(tmp_path / "num.jsonl"))
    # Parquet records, another text field
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [f"def f{i}(x):\n    return x + {i}\n" for i in range(60)]}),
                   str(tmp_path / "d.parquet"))
    pc = load_corpus(DataConfig(source=str(tmp_path / "d.parquet"), text_field="content", val_fraction=0.2,
                                tokenizer=str(assets / "tok.json"), cache_dir=str(tmp_path / "cache")))
    assert pc.train.numel() > 100 and pc.val.numel() > 0 and "60 records" in pc.description
    assert "no field 'text'" in err(source=str(tmp_path / "d.parquet"))
    # a restart does not re-tokenize: the cache answers without reading a record
    import p2pdiloco.tokenized as tokenized

    def no_reading(*a, **k):
        raise AssertionError("re-tokenized")

    real, tokenized.iter_documents = tokenized.iter_documents, no_reading
    try:
        again = load_corpus(DataConfig(source=str(tmp_path / "d.parquet"), text_field="content", val_fraction=0.2,
                                       tokenizer=str(assets / "tok.json"), cache_dir=str(tmp_path / "cache")))
    finally:
        tokenized.iter_documents = real
    assert again.digest == pc.digest and torch.equal(again.train, pc.train)
    # an empty shard: too few tokens in this peer's region
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(40)))
    corpus = load_corpus(DataConfig(source=str(small), val_fraction=0.3, cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ConfigError, match="data shard 3 of 16 has"):
        BatchStream(corpus.train, shard=3, num_shards=16, batch_size=2, seq_len=64, seed=0)
    # tokenizer / vocabulary mismatch, through the real CLI: one line, exit 2
    r = subprocess.run(cli_argv("join", "--config", TINY, *_sets(_llama(assets, "model.vocab_size=300"))),
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: data.tokenizer"), r.stderr
    assert f"set model.vocab_size={VOCAB}" in r.stderr
    r = subprocess.run(cli_argv("tokenizer", "train", "--data", str(tmp_path / "other.jsonl"), "--vocab-size", "300",
                                "--out", str(tmp_path / "t.json")), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: record 0 of") and "--text-field" in r.stderr, \
        r.stderr
    with pytest.raises(ConfigError, match="not a transformers architecture name"):
        load_config(TINY, _llama(assets, "model.hf_config=nosuchmodel"))
    from p2pdiloco.model import build_model

    with pytest.raises(ConfigError, match="has no causal language model"):
        build_model(load_config(TINY, _llama(assets, "model.hf_config=vit")).model)
    with pytest.raises(ConfigError, match="must be 256 for byte-level data"):
        load_config(TINY, ["model.vocab_size=300"])

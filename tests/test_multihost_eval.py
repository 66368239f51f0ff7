"""`car-jax eval` as 2 processes x 4 CPU devices (jax.distributed on loopback) equals the same
eval as 1 process x 8 devices, and both equal the default one-device eval without a mesh:
the same summary.json (all but the `run` timings) and samples.jsonl, written once by
process 0, each example once. 6 world questions in batches of 5 over fsdp=8, each padded
to 8 rows with copies of its last question: in the first batch process 0 holds 4 questions
and process 1 one question and 3 copies, in the second (1 question) process 0 holds it and
3 copies and process 1 only copies; the copies' results must be dropped."""
import json

import pytest

from car_jax.assets import smollm2_gguf
from car_jax.loading import load_tokenizer
from tests.hf_factory import build
from tests.multihost import launch, succeeded

N_EXAMPLES = 6


@pytest.fixture(scope="module")
def varied_folder(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer whose greedy text differs between the
    questions: with the default init (std 0.02) every row writes the same newlines, and
    equal responses in equal order would not show that each row went to its example."""
    folder = tmp_path_factory.mktemp("tiny_eval_policy")
    build("llama", folder, vocab_size=49152, hidden_size=32, initializer_range=0.2)
    load_tokenizer(smollm2_gguf()).save_pretrained(str(folder))
    return folder


def eval_args(folder, out, *extra, batch_size=5) -> list[str]:
    """A tiny random model, the search agent with the world BM25 tool, one tool turn of 6
    greedy tokens (random text: an invalid action, answered with a message, not a search)."""
    return ["eval", f"model.path={folder}", "data.path=world", "data.split=dev", f"data.limit={N_EXAMPLES}",
            "mode=search", "tools.retriever=world", f"batch_size={batch_size}", "episode.max_turns=1",
            "episode.max_response_tokens=6", "episode.max_obs_tokens=16", "output.n_boot=50", f"output.dir={out}",
            *extra]


def read_run(out):
    """(summary.json without its `run` timings, its run counts, samples.jsonl's records)."""
    summary = json.loads((out / "summary.json").read_text())
    run = summary.pop("run")
    counts = {k: run[k] for k in ("new_examples", "resumed_examples", "sampled_tokens", "episode")}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return summary, counts, samples


def test_two_processes_eval_like_one_and_like_no_mesh(varied_folder, tmp_path):
    from car_jax.cli import main

    one, two, plain = tmp_path / "1x8", tmp_path / "2x4", tmp_path / "no_mesh"
    # 1 process x 8 devices, and the no-mesh eval: this test's own process (8 CPU devices)
    assert main(eval_args(varied_folder, one, "mesh.devices=0")) == 0
    results = launch(eval_args(varied_folder, two, "mesh.devices=0"), processes=2, devices=4)
    succeeded(results)
    # the default: one device, no mesh, no padding. One batch of 6 rows: batches of 5 and 1
    # would compile the decode loop for two batch sizes; greedy text does not depend on
    # how the questions are batched
    assert main(eval_args(varied_folder, plain, batch_size=N_EXAMPLES)) == 0

    summary, counts, samples = read_run(one)
    ids = [s["id"] for s in samples]
    assert len(ids) == N_EXAMPLES and len(set(ids)) == N_EXAMPLES  # each example once, padded rows dropped
    assert counts["new_examples"] == N_EXAMPLES and counts["sampled_tokens"] > 0
    assert len({s["response"] for s in samples}) == N_EXAMPLES  # see varied_folder
    for other in (two, plain):
        o_summary, o_counts, o_samples = read_run(other)
        assert [s["id"] for s in o_samples] == ids, other.name
        # greedy decoding of the same rows: the same text, so the same records and, as the
        # summary is a function of them, exactly the same summary
        assert o_samples == samples, other.name
        assert o_summary == summary, other.name
        assert o_counts == counts, other.name  # sampled_tokens counts real rows only
    # one writer: process 1 wrote no file of its own and printed no report
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert "ECE" in results[0][1] and "ECE" not in results[1][1] and "wrote" not in results[1][1]


def test_a_mesh_beyond_the_machine_fails_in_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import jax

    import car_jax.eval.job
    from car_jax.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the mesh was checked")

    monkeypatch.setattr(car_jax.eval.job, "load_eval_model", refuse)
    n = jax.device_count()
    assert main(["eval", f"mesh.devices={n + 1}", f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"car-jax eval: error: mesh.devices: {n + 1} devices") and err.count("\n") == 1, err

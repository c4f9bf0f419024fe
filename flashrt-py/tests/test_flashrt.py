"""The capsule contract through the Python API, on the CPU reference and the repository's
Hugging Face fixtures (the same properties flashrt-runtime/tests/capsule.rs pins down in Rust),
and greedy outputs against the Rust CLI's (`flashrt run`) on the same inputs.

Run from the repository root after installing the wheel:
    pytest flashrt-py/tests
The CLI comparison needs the `flashrt` binary: $FLASHRT_BIN, else target/{debug,release}/flashrt
(`cargo build` makes it); without it those tests are skipped and say so, unless $FLASHRT_BIN
is set (then a missing binary fails).
"""

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import flashrt

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TEXT = FIXTURES / "text"
NAMES = ["qwen35-public", "lfm2-public", "nemotronh-public"]
BUCKETS = [4, 16]


def load(name, **kw):
    kw.setdefault("buckets", BUCKETS)
    kw.setdefault("max_seq", 256)
    return flashrt.Model(FIXTURES / name, backend="cpu", **kw)


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    return load(request.param)


@pytest.fixture(scope="module")
def models():
    return {n: load(n) for n in NAMES}


def tokens(seed, n, vocab):
    r = random.Random(seed)
    return [r.randrange(vocab) for _ in range(n)]


def state(s):
    return {r: s.read_region(r) for r in s.model.state_regions}


def logits(s):
    return np.asarray(s.logits(), dtype=np.float32)


def test_restore_is_byte_exact_after_dirtying(model):
    v = model.vocab
    s = model.session()
    s.append(tokens(1, 37, v))
    cap = s.snapshot()
    before = state(s)
    before_logits = logits(s).copy()
    assert set(before) == set(model.state_regions) and before
    for region, b in before.items():
        assert cap.region(region) == b, region
    assert cap.pos == 37 and cap.tokens == tokens(1, 37, v)
    assert cap.nbytes == sum(len(b) for b in before.values())
    assert cap.model == model.name and cap.fingerprint == model.fingerprint

    s.decode_greedy(5)
    s.append(tokens(2, 20, v))
    s.reset()
    s.append(tokens(3, 51, v))
    assert state(s) != before, "dirtying changed nothing"

    s.restore(cap)
    assert state(s) == before
    assert s.pos == 37 and s.tokens == tokens(1, 37, v)
    assert np.array_equal(logits(s), before_logits)

    # The session now holds the capsule's K/V rows: a reset to it after moving on copies
    # only the rest, and still leaves every byte the capsule holds.
    assert s.rows_held(cap) == 37
    s.decode_greedy(4)
    assert s.rows_held(cap) == 37
    s.restore(cap)
    assert state(s) == before
    s.reset()
    assert s.rows_held(cap) == 0


def test_two_forks_equal_two_cold_runs(model):
    v = model.vocab
    prefix = tokens(4, 29, v)
    s = model.session()
    s.append(prefix)
    cap = s.snapshot()
    for seed in (5, 6):
        suffix = tokens(seed, 11, v)
        branch = model.fork(cap)
        branch.append(suffix)
        cold = model.session()
        cold.append(prefix + suffix)
        assert np.array_equal(logits(branch), logits(cold))
        assert state(branch) == state(cold)
        assert branch.decode_greedy(8) == cold.decode_greedy(8)
    # The parent is untouched by its forks.
    assert s.pos == 29 and state(s) == {r: cap.region(r) for r in model.state_regions}


def test_step_batch_equals_each_session_stepping(model):
    # Sessions at different positions (two forks of one capsule among them), stepped together
    # over changing subsets: each ends as after its own steps, bit for bit.
    v = model.vocab
    batch, alone = [], []
    for i in range(4):
        s = model.session()
        s.append(tokens(40 + i, 3 + 5 * i, v))
        batch.append(s)
        alone.append(model.fork(s.snapshot()))
    cap = batch[1].snapshot()
    batch.append(model.fork(cap))
    alone.append(model.fork(cap))
    for who in ([0, 1, 2, 3, 4], [4, 1], [2, 0, 3]):
        toks = [int(np.argmax(logits(batch[i]))) for i in who]
        model.step_batch([batch[i] for i in who], toks)
        for i, t in zip(who, toks):
            alone[i].step(t)
            assert np.array_equal(logits(batch[i]), logits(alone[i]))
    for b, a in zip(batch, alone):
        assert b.pos == a.pos and b.tokens == a.tokens and state(b) == state(a)
    # Refused before anything runs.
    with pytest.raises(ValueError, match="same session"):
        model.step_batch([batch[0], batch[0]], [1, 1])
    with pytest.raises(ValueError, match="2 sessions but 1 tokens"):
        model.step_batch([batch[0], batch[1]], [1])
    with pytest.raises(ValueError, match="out of range"):
        model.step_batch([batch[0], batch[1]], [1, v])
    assert [b.pos for b in batch] == [a.pos for a in alone]


def test_restore_and_append_at_any_boundary_equals_cold_prefill_bitwise(model):
    v = model.vocab
    full = tokens(7, 40, v)
    cold = model.session()
    cold.append(full)
    cold_logits, cold_state = logits(cold).copy(), state(cold)
    dirty = model.session()
    for split in (1, 3, 4, 5, 16, 17, 33, 39):
        s = model.session()
        s.append(full[:split])
        cap = s.snapshot()
        dirty.reset()
        dirty.append(tokens(8 + split, 23, v))
        dirty.restore(cap)
        dirty.append(full[split:])
        assert np.array_equal(logits(dirty), cold_logits), f"split {split}"
        assert state(dirty) == cold_state, f"split {split}"


def test_rollback_returns_to_an_earlier_boundary(model):
    v = model.vocab
    s = model.session()
    s.append(tokens(9, 20, v))
    c1 = s.snapshot()
    ids = s.decode_greedy(6)
    c2 = s.snapshot()
    s.rollback(c1)
    assert s.pos == 20
    assert s.decode_greedy(6) == ids
    s.rollback(c2)
    other = model.session()
    other.append(tokens(13, 30, v))
    with pytest.raises(flashrt.Error, match="not a boundary"):
        s.rollback(other.snapshot())
    s.rollback(c1)
    with pytest.raises(flashrt.Error):
        s.rollback(c2)  # rolling forward
    s.restore(c2)  # ... but a plain restore to it is fine
    assert s.pos == 26


def test_kv_only_ablation_diverges(model):
    v = model.vocab
    s = model.session()
    s.append(tokens(14, 37, v))
    cap = s.snapshot()
    suffix = tokens(15, 9, v)
    truth = model.fork(cap)
    truth.append(suffix)
    ab = model.session()
    ab.append(tokens(16, 37, v))
    ab.restore_kv_only(cap)
    ab.append(suffix)
    diff = float(np.max(np.abs(logits(ab) - logits(truth))))
    assert diff > 1e-3, f"KV-only restore did not diverge ({diff})"
    ab.restore(cap)
    ab.append(suffix)
    assert np.array_equal(logits(ab), logits(truth))


def test_wrong_model_is_a_type_error_naming_both(models):
    qwen, lfm2 = models["qwen35-public"], models["lfm2-public"]
    s = lfm2.session()
    s.append([5, 6, 7])
    cap = s.snapshot()
    q = qwen.session()
    with pytest.raises(flashrt.CapsuleTypeError) as e:
        q.restore(cap)
    assert isinstance(e.value, TypeError)
    assert lfm2.name in str(e.value) and qwen.name in str(e.value), str(e.value)
    for f in (qwen.fork, q.restore_kv_only, q.rollback):
        with pytest.raises(TypeError):
            f(cap)
    assert q.pos == 0  # a refused restore leaves the session as it was
    # The same checkpoint with another max_seq has another layout, so another type.
    other = load("lfm2-public", max_seq=128)
    assert other.fingerprint != lfm2.fingerprint
    with pytest.raises(flashrt.CapsuleTypeError):
        other.fork(cap)


def test_capsule_files_round_trip_and_are_checked(models, tmp_path):
    m = models["nemotronh-public"]
    s = m.session()
    s.append(tokens(17, 25, m.vocab))
    cap = s.snapshot()
    path = tmp_path / "c.capsule"
    size = cap.save(path)
    assert size == path.stat().st_size and size > cap.nbytes
    back = m.load_capsule(path)
    assert back.pos == 25 and back.tokens == cap.tokens
    for r in m.state_regions:
        assert back.region(r) == cap.region(r)
    t = m.fork(back)
    assert t.decode_greedy(6) == s.decode_greedy(6)
    with pytest.raises(flashrt.CapsuleTypeError):
        models["qwen35-public"].load_capsule(path)
    raw = bytearray(path.read_bytes())
    raw[-9] ^= 0x40
    bad = tmp_path / "bad.capsule"
    bad.write_bytes(bytes(raw))
    with pytest.raises(flashrt.Error):
        m.load_capsule(bad)
    with pytest.raises(flashrt.Error, match="missing.capsule"):
        m.load_capsule(tmp_path / "missing.capsule")


def test_generate_yields_each_token_before_its_step(models):
    m = models["qwen35-public"]
    prompt = tokens(18, 12, m.vocab)
    ref = m.session()
    ref.append(prompt)
    want = ref.decode_greedy(6)
    s = m.session()
    s.append(prompt)
    g = s.generate(6, temperature=0, ignore_eos=True)
    first = next(g)
    assert first.id == want[0]
    # A yielded token is part of the history whatever comes next (it is fed lazily).
    assert s.pos == 12 + 1
    rest = [t.id for t in g]
    assert [first.id] + rest == want
    assert s.tokens == prompt + want
    # Breaking out early keeps exactly what was yielded.
    s2 = m.session()
    s2.append(prompt)
    for i, _ in enumerate(s2.generate(6, temperature=0, ignore_eos=True)):
        if i == 2:
            break
    assert s2.tokens == prompt + want[:3]


def test_sampling_is_seeded_and_validated(models):
    m = models["lfm2-public"]
    prompt = tokens(19, 9, m.vocab)
    runs = []
    for _ in range(2):
        s = m.session()
        s.append(prompt)
        runs.append([t.id for t in s.generate(10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)])
    assert runs[0] == runs[1]
    s = m.session()
    s.append(prompt)
    with pytest.raises(ValueError):
        s.generate(4, temperature=-1.0)
    with pytest.raises(ValueError):
        s.generate(4, top_p=1.5)
    with pytest.raises(ValueError, match="min_p"):
        s.generate(4, min_p=1.5)
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy.
    g = m.session()
    g.append(prompt)
    greedy = g.decode_greedy(8)
    s = m.session()
    s.append(prompt)
    assert [t.id for t in s.generate(8, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True)] == greedy


def test_the_cpu_ignores_the_choice_of_decode_matmuls(models):
    m = models["lfm2-public"]
    tc = load("lfm2-public", decode_matmuls="tensor-cores")
    prompt = tokens(21, 12, m.vocab)
    a, b = m.session(), tc.session()
    a.append(prompt)
    b.append(prompt)
    assert np.array_equal(logits(a), logits(b))
    assert a.decode_greedy(6) == b.decode_greedy(6)


def test_bad_input_raises_clear_errors(models, tmp_path):
    m = models["qwen35-public"]
    s = m.session()
    with pytest.raises(ValueError, match=str(m.vocab)):
        s.append([m.vocab + 5])
    with pytest.raises(ValueError, match="empty"):
        s.append([])
    with pytest.raises(ValueError, match="tokenizer"):
        s.append("text without a tokenizer")
    with pytest.raises(ValueError, match="backend"):
        flashrt.Model(FIXTURES / "qwen35-public", backend="tpu")
    with pytest.raises(ValueError, match="tensor-cores"):
        flashrt.Model(FIXTURES / "qwen35-public", decode_matmuls="tpu-cores")
    with pytest.raises(flashrt.Error):
        flashrt.Model(tmp_path / "nowhere")
    with pytest.raises(ValueError):
        s.read_region("no.such.region")
    assert s.pos == 0


def test_the_gil_is_released_while_the_backend_works(models):
    m = models["nemotronh-public"]
    s = m.session()
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    calls = 0
    ran = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        s.reset()
        c0 = count[0]
        s.append(tokens(20, 200, m.vocab))
        ran += count[0] - c0
        calls += 1
    stop.set()
    th.join()
    # With the GIL held through `append` the spinning thread could not count at all while
    # it ran; released, it counts throughout.
    assert ran > 1000 * calls, (ran, calls)


def test_sessions_shared_between_threads_take_turns(models):
    m = models["lfm2-public"]
    prompt = tokens(21, 10, m.vocab)
    s = m.session()
    s.append(prompt)
    steps = tokens(22, 40, m.vocab)
    errors = []

    def worker(part):
        try:
            for t in part:
                s.step(t)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(steps[i::4],)) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors
    assert s.pos == 50 and sorted(s.tokens[10:]) == sorted(steps)
    # Whatever order they took, the state is the state of that history.
    cold = m.session()
    cold.append(s.tokens)
    assert state(cold) == state(s)


# --- Against the Rust CLI --------------------------------------------------------------------


def flashrt_bin():
    env = os.environ.get("FLASHRT_BIN")
    if env:
        assert Path(env).is_file(), f"FLASHRT_BIN={env} does not exist"
        return env
    for p in ("target/release/flashrt", "target/debug/flashrt"):
        if (ROOT / p).is_file():
            return str(ROOT / p)
    pytest.skip("no flashrt binary (set FLASHRT_BIN or run `cargo build`): CLI comparison skipped")


def cli_run(*args):
    out = subprocess.run(
        [flashrt_bin(), "run", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_greedy_ids_equal_the_cli(name):
    m = flashrt.Model(FIXTURES / name, backend="cpu")
    prompt = tokens(23, 14, m.vocab)
    stdout = cli_run(
        FIXTURES / name,
        " ".join(map(str, prompt)),
        "--backend", "cpu", "--temperature", "0", "--max-tokens", "12", "--ignore-eos",
    )
    want = [int(x) for x in stdout.split()]
    s = m.session()
    s.append(prompt)
    got = [t.id for t in s.generate(12, temperature=0, ignore_eos=True)]
    assert got == want and len(want) == 12


def test_greedy_text_and_chat_equal_the_cli():
    tok = TEXT / "tokenizer.json"
    real = FIXTURES / "qwen35real-public"
    m = flashrt.Model(real, backend="cpu", tokenizer=tok)
    assert m.has_tokenizer and m.has_chat_template
    args = ("--tokenizer", tok, "--backend", "cpu", "--temperature", "0", "--max-tokens", "10", "--ignore-eos")

    raw = "The robot arm moves to the left"
    want = cli_run(real, raw, "--raw", *args)
    s = m.session()
    s.append(raw)
    assert s.tokens == m.encode(raw)
    got = "".join(t.text for t in s.generate(10, temperature=0, ignore_eos=True))
    assert got + "\n" == want

    msgs = [{"role": "user", "content": "Where is the gripper?"}]
    want = cli_run(real, msgs[0]["content"], *args)
    g = m.chat(msgs, max_tokens=10, temperature=0, ignore_eos=True)
    assert g.text() + "\n" == want
    # The rendering is the template's as transformers renders it (the fixtures' cases).
    for case in json.loads((TEXT / "chat_cases.json").read_text()):
        text = m.render_chat(
            case["messages"],
            tools=case.get("tools"),
            add_generation_prompt=case["add_generation_prompt"],
            **case["kwargs"],
        )
        assert text == case["expected_text"], case["name"]
        assert m.encode(text) == case["expected_ids"], case["name"]


def test_chat_with_a_session_feeds_only_the_new_turn():
    m = flashrt.Model(FIXTURES / "qwen35real-public", backend="cpu", tokenizer=TEXT / "tokenizer.json")
    msgs = [{"role": "user", "content": "Pick up the cube."}]
    g = m.chat(msgs, max_tokens=4, temperature=0, ignore_eos=True)
    reply = g.text()
    s = g.session
    turn1 = s.snapshot()
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now the ball."}]
    prompt2 = m.encode(m.render_chat(msgs2))
    s.restore(turn1)
    # The restored history is a prefix of the new prompt exactly when the template renders
    # the first turn the same way inside the longer conversation.
    shared = 0
    while shared < min(len(prompt2), turn1.pos) and prompt2[shared] == turn1.tokens[shared]:
        shared += 1
    g2 = m.chat(msgs2, session=s, max_tokens=4, temperature=0, ignore_eos=True)
    assert g2.reused == (turn1.pos if shared == turn1.pos else 0)
    a = [t.id for t in g2]
    cold = m.session()
    cold.append(prompt2)
    assert a == [t.id for t in cold.generate(4, temperature=0, ignore_eos=True)]


# --- The examples and the benchmark script run (demo model, CPU, a few iterations) ----------


@pytest.mark.parametrize(
    "script,args",
    [
        ("examples/python/robot_loop.py", ["--backend", "cpu", "--ticks", "9", "--warmup", "3", "--hz", "500", "--rust"]),
        ("examples/python/tree_search.py", ["--backend", "cpu", "--width", "3", "--depth", "2", "--tokens", "3"]),
        ("benches/python_overhead.py", ["--backend", "cpu", "--steps", "4", "--rounds", "3"]),
    ],
)
def test_examples_run(script, args, tmp_path):
    out = tmp_path / "out.json"
    extra = ["--json", str(out)] if "tree_search" not in script else []
    r = subprocess.run(
        [sys.executable, str(ROOT / script), *args, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    if extra:
        figures = json.loads(out.read_text())
        assert figures["backend"].startswith("cpu")
    else:
        assert "best path" in r.stdout


def test_fp8_checkpoints_and_quantizing_while_loading():
    # An FP8 checkpoint loads as stored, and `quantize="fp8"` quantizes a float one while it
    # loads (bit-exactness against the FP8 fixtures is the Rust suite's `tests/fp8.rs`).
    fp8 = load("qwen35fp8-public")
    p = tokens(5, 19, 512)
    a = fp8.session()
    a.append(p)
    assert np.isfinite(logits(a)).all()
    plain = load("qwen35-public")
    q = load("qwen35-public", quantize="fp8")
    s, t = plain.session(), q.session()
    s.append(p)
    t.append(p)
    ls, lt = logits(s), logits(t)
    # Quantized (the Rust suite checks the values bit for bit), still a working model.
    assert not np.array_equal(ls, lt)
    assert np.isfinite(lt).all()
    with pytest.raises(ValueError, match="unknown quantization"):
        load("qwen35-public", quantize="int4")


def test_appends_run_the_planned_steps_and_calibration_keeps_results(model):
    """The chunk planner through Python: the steps of an append cover its tokens (a few
    tokens one verify pass or decode step, more the prefill buckets), timing the plans
    changes at most which steps run, never a bit of the result."""
    v = model.vocab
    for n in [1, 3, 17, 40]:
        plan = model.chunk_plan(n)
        assert sum(rows for _, rows in plan) == n
    assert model.chunk_plan(1) == [("decode", 1)]
    prompt = tokens(71, 40, v)
    before = model.session()
    before.append(prompt)
    table = model.calibrate_chunking(runs=1)
    labels = [label for label, _, _ in table]
    assert "decode" in labels and "prefill[16]" in labels and "verify[4]" in labels
    assert all(ms > 0 and per_row >= 0 for _, ms, per_row in table)
    after = model.session()
    after.append(prompt)
    assert np.array_equal(logits(before), logits(after))
    assert state(before) == state(after)

import math

import pytest
import torch

from workbench.errors import DataError
from workbench.evaluation.evaluate import (capture_reference, encode_text, eval_windows, evaluate, llamacpp_windows,
                                paired_difference, read_text, strided_windows)
from workbench.model.load import load_model


def hand_perplexity(model, ids, ctx, stride):
    """The Hugging Face perplexity guide's loop, written independently: labels masked with -100."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        trg_len = end - prev_end
        x = ids[begin:end][None]
        labels = x.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(x).logits[0, :-1]
        lab = labels[0, 1:]
        mask = lab != -100
        nll_sum += torch.nn.functional.cross_entropy(logits[mask], lab[mask], reduction="sum").item()
        n_tokens += int(mask.sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens), n_tokens


def test_windows_score_each_token_at_most_once():
    for n, ctx, stride in [(100, 16, 16), (100, 16, 8), (17, 16, 5), (5, 16, 16)]:
        ws = strided_windows(n, ctx, stride)
        scored = [t for w in ws for t in range(w.score_from, w.end)]
        assert scored == sorted(set(scored)) and all(w.end - w.begin <= ctx for w in ws)
        if stride < ctx:  # overlapping windows give every token (but the first) some context
            assert scored == list(range(1, n)), (n, ctx, stride)
        else:  # non-overlapping: a window's first token has no context and is not scored
            assert len(scored) == n - len(ws)


@pytest.mark.parametrize("ctx, stride", [(16, 16), (16, 8), (32, 5)])
def test_perplexity_matches_hand_computation(lm, ctx, stride):
    torch.manual_seed(0)
    ids = torch.randint(0, 4096, (101,))
    expected, n = hand_perplexity(lm.model, ids, ctx, stride)
    report = evaluate(lm.model, ids, ctx=ctx, stride=stride, batch_size=3, progress=False)
    assert report.tokens == n == (100 if stride < ctx else 101 - len(strided_windows(101, ctx, stride)))
    assert report.perplexity == pytest.approx(expected, rel=1e-5)


def test_model_against_itself(lm):
    ids = torch.randint(0, 4096, (80,), generator=torch.Generator().manual_seed(1))
    report = evaluate(lm.model, ids, reference=lm.model, ctx=32, progress=False)
    assert report.kl_divergence == pytest.approx(0.0, abs=1e-7)
    assert report.top1_agreement == 1.0
    assert report.reference_perplexity == pytest.approx(report.perplexity)


def test_kl_and_agreement_detect_a_different_model(lm, make_tiny_model):
    other = load_model(make_tiny_model(seed=5)).model
    ids = torch.randint(0, 4096, (80,), generator=torch.Generator().manual_seed(1))
    report = evaluate(other, ids, reference=lm.model, ctx=32, progress=False)
    assert report.kl_divergence > 1e-3 and report.top1_agreement < 1.0
    # KL computed by hand on the first scored token
    with torch.no_grad():
        p = torch.log_softmax(lm.model(ids[None, :2]).logits[0, 0], -1)
        q = torch.log_softmax(other(ids[None, :2]).logits[0, 0], -1)
    first = (p.exp() * (p - q)).sum().item()
    assert report.window_kl[0] >= first * 0.999  # window sum includes the first token


def test_captured_reference_gives_same_numbers(lm, make_tiny_model):
    other = load_model(make_tiny_model(seed=5)).model
    ids = torch.randint(0, 4096, (80,), generator=torch.Generator().manual_seed(2))
    direct = evaluate(other, ids, reference=lm.model, ctx=32, progress=False)
    ref = capture_reference(lm.model, ids, ctx=32, progress=False)
    cached = evaluate(other, ids, reference=ref, ctx=32, progress=False)
    assert cached.kl_divergence == pytest.approx(direct.kl_divergence, rel=1e-6)
    assert cached.top1_agreement == direct.top1_agreement
    with pytest.raises(ValueError, match="capture them again"):
        evaluate(other, ids, reference=ref, ctx=16, progress=False)


def test_paired_difference(lm, make_tiny_model):
    other = load_model(make_tiny_model(seed=5)).model
    ids = torch.randint(0, 4096, (120,), generator=torch.Generator().manual_seed(3))
    a = evaluate(other, ids, ctx=16, progress=False)
    b = evaluate(lm.model, ids, ctx=16, progress=False)
    d = paired_difference(a, b)
    assert d["mean"] == pytest.approx(a.nll - b.nll)
    assert d["stderr"] > 0 and d["windows"] == a.windows
    assert paired_difference(b, b) == {"mean": 0.0, "stderr": 0.0, "windows": b.windows}


def hand_llamacpp_nll(model, ids, ctx):
    """llama-perplexity's loop, written from its description: per whole chunk, logits at positions
    ctx/2 .. ctx-2 predict the next token; a partial last chunk is dropped."""
    nll, n, first = 0.0, 0, ctx // 2
    for c in range(len(ids) // ctx):
        x = ids[c * ctx:(c + 1) * ctx]
        with torch.no_grad():
            lp = torch.log_softmax(model(x[None]).logits[0], -1)
        for j in range(first, ctx - 1):
            nll -= lp[j, x[j + 1]].item()
            n += 1
    return nll, n


def test_llamacpp_scheme_matches_its_chunks(lm, make_tiny_model):
    ids = torch.randint(0, 4096, (100,), generator=torch.Generator().manual_seed(4))
    ws = llamacpp_windows(100, 32)
    assert [(w.begin, w.end, w.score_from) for w in ws] == [(0, 32, 17), (32, 64, 49), (64, 96, 81)]
    nll, n = hand_llamacpp_nll(lm.model, ids, 32)
    report = evaluate(lm.model, ids, ctx=32, progress=False, scheme="llama.cpp")
    assert report.tokens == n == 3 * 15 and report.scheme == "llama.cpp"
    assert report.nll == pytest.approx(nll / n, rel=1e-5)
    # a stored reference remembers its scheme; comparing under another one is refused
    ref = capture_reference(lm.model, ids, ctx=32, progress=False, scheme="llama.cpp")
    other = load_model(make_tiny_model(seed=5)).model
    assert evaluate(other, ids, reference=ref, ctx=32, progress=False, scheme="llama.cpp").kl_divergence > 0
    with pytest.raises(ValueError, match="capture them again"):
        evaluate(other, ids, reference=ref, ctx=32, progress=False)


def test_llamacpp_scheme_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="fewer than one chunk of 64"):
        llamacpp_windows(50, 64)
    with pytest.raises(ValueError, match="drop --stride"):
        eval_windows(100, 32, 16, "llama.cpp")
    with pytest.raises(ValueError, match="choose one of strided, llama.cpp"):
        eval_windows(100, 32, None, "hf")


def test_ctx_beyond_model_limit(lm):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        evaluate(lm.model, torch.arange(10), ctx=100_000, progress=False)


def test_empty_text_errors(lm, tmp_path):
    with pytest.raises(DataError, match="empty"):
        encode_text(lm.tokenizer, "   ")
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        read_text(tmp_path / "e.txt")
    with pytest.raises(DataError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match="not UTF-8"):
        read_text(tmp_path / "b.txt")


def _log_probs_from_full_logits(model, ids, ctx):
    """The plain method: the model's own logits, whole windows at once."""
    from workbench.evaluation.evaluate import strided_windows
    out = []
    with torch.no_grad():
        for w in strided_windows(len(ids), ctx):
            logits = model(input_ids=ids[w.begin:w.end][None]).logits[0].float()
            out.append(torch.log_softmax(logits[w.score_from - w.begin - 1: w.end - w.begin - 1], -1))
    return out


def test_streaming_evaluation_equals_full_logits(tiny_model_dir, monkeypatch):
    """Hidden states + the head a chunk of tokens at a time give the figures of whole-window logits."""
    import sys

    from workbench.evaluation.evaluate import capture_reference, evaluate, reference_report, strided_windows
    from workbench.model.load import load_model
    monkeypatch.setattr(sys.modules["workbench.evaluation.evaluate"], "HEAD_CHUNK_TOKENS", 7)  # several chunks per window
    ref = load_model(tiny_model_dir)
    cand = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in cand.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
    ids = torch.randint(0, 4096, (300,), generator=torch.Generator().manual_seed(2))
    ctx = 64
    ref_lp, cand_lp = _log_probs_from_full_logits(ref.model, ids, ctx), _log_probs_from_full_logits(cand.model, ids, ctx)
    windows = strided_windows(len(ids), ctx)
    nll = -sum(lp.gather(1, ids[w.score_from:w.end, None]).sum() for lp, w in zip(cand_lp, windows))
    kl = sum((r.exp() * (r - c)).sum(-1).clamp_min(0).sum() for r, c in zip(ref_lp, cand_lp))
    n = sum(w.scored for w in windows)
    stored = capture_reference(ref.model, ids, ctx=ctx, progress=False)
    for reference in (ref.model, stored):
        rep = evaluate(cand.model, ids, reference=reference, ctx=ctx, progress=False)
        assert rep.nll == pytest.approx(float(nll) / n, rel=1e-6)
        assert rep.kl_divergence == pytest.approx(float(kl) / n, rel=1e-5)
    # the compact reference holds hidden states and one head, far less than tokens x vocabulary
    assert stored.nbytes < n * 4096 * 4
    own = reference_report(stored, ids)
    plain = evaluate(ref.model, ids, ctx=ctx, progress=False)
    assert own.perplexity == pytest.approx(plain.perplexity, rel=1e-6)


def test_default_budget_is_the_whole_text_on_small_models_and_whole_windows_on_big_ones(lm):
    from workbench.evaluation.evaluate import EVAL_BUDGET, MIN_EVAL_WINDOWS, default_token_budget
    assert default_token_budget(lm.model, 23_000, 512) == 23_000
    params = sum(p.numel() for p in {id(p): p for p in lm.model.parameters()}.values())

    class Big(torch.nn.Module):  # parameter count of a 0.5 B model without allocating it
        def parameters(self):
            return iter([torch.empty(1).expand(494_000_000)])
    budget = default_token_budget(Big(), 23_000, 512)
    assert (budget - 1) % 512 == 0 and budget - 1 >= EVAL_BUDGET / 494e6 and budget - 1 >= MIN_EVAL_WINDOWS * 512
    assert params < 494e6


def test_kept_reference_log_probs_give_the_same_figures_and_stay_within_their_budget(lm, make_tiny_model, monkeypatch):
    """Many comparisons against one reference keep its log-probabilities once (one output layer per evaluation)."""
    import sys
    monkeypatch.setattr(sys.modules["workbench.evaluation.evaluate"], "HEAD_CHUNK_TOKENS", 16)  # several chunks per window
    other = load_model(make_tiny_model(seed=5)).model
    ids = torch.randint(0, 4096, (80,), generator=torch.Generator().manual_seed(2))
    rebuilt = capture_reference(lm.model, ids, ctx=32, progress=False)
    kept = capture_reference(lm.model, ids, ctx=32, progress=False)
    scored = sum(h.shape[0] for h in kept.hidden)
    assert not kept.keep_log_probs(scored * 4096 * 4 - 1)  # one byte short of all of them: none kept
    assert kept.keep_log_probs(scored * 4096 * 4)
    first = evaluate(other, ids, reference=kept, ctx=32, progress=False)
    assert len(kept._kept) == sum(-(-h.shape[0] // 16) for h in kept.hidden)  # every chunk of every window
    assert kept.nbytes >= scored * 4096 * 4
    held = dict(kept._kept)
    again = evaluate(other, ids, reference=kept, ctx=32, progress=False)
    assert all(kept._kept[k] is t for k, t in held.items())  # reused, and never written into
    plain = evaluate(other, ids, reference=rebuilt, ctx=32, progress=False)
    assert not rebuilt._kept
    for report in (first, again):
        assert (report.window_kl, report.window_nll, report.window_top1) == \
            (plain.window_kl, plain.window_nll, plain.window_top1)  # bit for bit
    assert torch.equal(held[(0, 0, 16)], torch.log_softmax(rebuilt.logits(0, slice(0, 16)), dim=-1))

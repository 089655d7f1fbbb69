"""EAGLE-3 drafter: checkpoint round trips, gradients, the chain unroll, teacher and vocab maps."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from sglang_tts.config import TTSConfig
from sglang_tts.core.canvas import Canvas, stack_rounds
from sglang_tts.core.distiller import Distiller
from sglang_tts.core.drafter_api import DifferentiableDrafter
from sglang_tts.drafters import Eagle3Drafter, UnsupportedDrafterConfigError, load_drafter
from sglang_tts.drafters.checkpoints import write_tiny_eagle3
from sglang_tts.drafters.common import append_kv
from sglang_tts.drafters.loading import load_checkpoint_tensors, read_config


@pytest.mark.parametrize("layout", ["midlayer", "layers.0"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_checkpoint_round_trip(tmp_path, llama_target, make_target_tensors, layout, fmt):
    path = write_tiny_eagle3(tmp_path / "ckpt", llama_target, layout=layout, fmt=fmt, draft_vocab_size=80, seed=3)
    assert (path / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")).is_file()
    cfg = read_config(path)
    # What SGLang's EAGLE3 loader and aux-capture setup read.
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 80 and cfg["vocab_size"] == llama_target["vocab_size"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]

    raw = load_checkpoint_tensors(path)
    assert any(k.startswith(layout + ".") for k in raw)
    drafter = load_drafter(path, target_embedding=make_target_tensors(llama_target)[0], target_config=llama_target)
    state = drafter.state_dict()
    for name, tensor in raw.items():
        own = name.replace("midlayer", "layers.0")
        assert own in state, name
        assert torch.equal(state[own], tensor), name
    assert set(state) == {n.replace("midlayer", "layers.0") for n in raw}
    assert drafter.fc.weight.shape == (64, 3 * 64)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 2 * 64)
    assert drafter.lm_head.weight.shape == (80, 64)


def test_layouts_give_the_same_model(tmp_path, llama_target, make_target_tensors, make_eagle3_inputs):
    embedding = make_target_tensors(llama_target)[0]
    a = load_drafter(write_tiny_eagle3(tmp_path / "a", llama_target, layout="midlayer"), target_embedding=embedding)
    b = load_drafter(
        write_tiny_eagle3(tmp_path / "b", llama_target, layout="layers.0", fmt="bin"), target_embedding=embedding
    )
    canvas = make_eagle3_inputs(a)["canvas"]
    torch.testing.assert_close(a.canvas_hidden(canvas), b.canvas_hidden(canvas), rtol=0, atol=0)


def test_gradients_reach_every_trainable_param_and_not_the_embedding(eagle3, make_eagle3_inputs):
    assert isinstance(eagle3, DifferentiableDrafter) and eagle3.kind == "eagle3"
    canvas = make_eagle3_inputs(eagle3)["canvas"]
    eagle3.zero_grad(set_to_none=True)
    logits = eagle3.canvas_logits(canvas)
    assert logits.shape == (2, 4, eagle3.cfg.draft_vocab_size)
    (logits * torch.randn_like(logits)).sum().backward()
    names = {n for n, _ in eagle3.trainable_named_parameters()}
    assert "fc.weight" in names and "lm_head.weight" in names and "norm.weight" in names
    assert not any("embed" in n for n in names)
    for name, param in eagle3.trainable_named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert eagle3.embed_weight is not None and not eagle3.embed_weight.requires_grad
    assert eagle3.embed_weight.grad is None


def _stepwise(drafter: Eagle3Drafter, canvas) -> torch.Tensor:
    """The chain as SGLang runs it: one draft step at a time, K/V cache grown from its own output."""
    cache, mask = canvas.past_kv, canvas.past_mask
    hidden = canvas.features  # step 0 takes target features, later steps the recycled hidden
    outs = []
    for k in range(canvas.length):
        step = drafter.draft_step(canvas.input_ids[:, k], hidden, canvas.positions[:, k], cache, mask)
        outs.append(step.hidden)
        hidden = step.aux[:, 0]
        cache = append_kv(cache, [(key.detach(), value.detach()) for key, value in step.kv])
        mask = torch.cat((mask, torch.ones(canvas.batch_size, 1, dtype=torch.bool)), dim=1)
    return torch.cat(outs, dim=1)


def test_chain_unroll_equals_step_by_step(eagle3, make_eagle3_inputs):
    canvas = make_eagle3_inputs(eagle3, length=5)["canvas"]
    with torch.no_grad():
        torch.testing.assert_close(eagle3.canvas_hidden(canvas), _stepwise(eagle3, canvas))


def test_first_position_is_the_last_draft_extend_row(eagle3, make_eagle3_inputs):
    """Canvas position 0 with past_kv from kv_for_context == the last row of one causal extend
    over context + anchor (what SGLang's draft extend computes in parallel)."""
    inputs = make_eagle3_inputs(eagle3)
    canvas = inputs["canvas"]
    with torch.no_grad():
        extended = eagle3.extend(
            torch.cat((inputs["ctx_ids"], canvas.input_ids[:, :1]), dim=1),
            torch.cat((inputs["ctx_feat"], canvas.features[:, None]), dim=1),
            torch.cat((inputs["ctx_pos"], canvas.positions[:, :1]), dim=1),
        )
        torch.testing.assert_close(eagle3.canvas_hidden(canvas)[:, 0], extended.hidden[:, -1])


def test_extend_is_causal(tmp_path, llama_target, make_target_tensors, make_eagle3_inputs):
    """A draft-extend row never sees later rows: a prefix of the rows gives the same outputs and
    (with 2 layers, where K/V depend on attention) the same K/V."""
    path = write_tiny_eagle3(tmp_path / "e2", llama_target, layout="layers.0", num_layers=2)
    drafter = load_drafter(path, target_embedding=make_target_tensors(llama_target)[0])
    inputs = make_eagle3_inputs(drafter)
    ids, feats, pos = inputs["ctx_ids"], inputs["ctx_feat"], inputs["ctx_pos"]
    with torch.no_grad():
        full = drafter.extend(ids, feats, pos)
        prefix = drafter.extend(ids[:, :3], feats[:, :3], pos[:, :3])
    torch.testing.assert_close(prefix.hidden, full.hidden[:, :3])
    torch.testing.assert_close(prefix.kv[1][0], full.kv[1][0][:, :, :3])


def test_only_relative_positions_matter_and_they_are_used(eagle3, make_eagle3_inputs):
    inputs = make_eagle3_inputs(eagle3)
    canvas = inputs["canvas"]
    shifted_past = eagle3.kv_for_context(inputs["ctx_ids"], inputs["ctx_feat"], inputs["ctx_pos"] + 17)
    with torch.no_grad():
        base = eagle3.canvas_hidden(canvas)
        shifted = eagle3.canvas_hidden(replace(canvas, positions=canvas.positions + 17, past_kv=shifted_past))
        moved = eagle3.canvas_hidden(replace(canvas, positions=canvas.positions + 3))
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(moved, base, atol=1e-4)


def test_masked_past_entries_are_ignored(eagle3, make_eagle3_inputs):
    inputs = make_eagle3_inputs(eagle3)
    canvas = inputs["canvas"]
    # Keep context rows 0, 2, 4 only: once by masking, once by never computing 1 and 3.
    keep = torch.tensor([True, False, True, False, True])
    with torch.no_grad():
        masked = eagle3.canvas_hidden(replace(canvas, past_mask=keep.expand(2, 5).clone()))
        sub_kv = [(k[:, :, keep], v[:, :, keep]) for k, v in canvas.past_kv]
        dropped = eagle3.canvas_hidden(replace(canvas, past_kv=sub_kv, past_mask=None))
        full = eagle3.canvas_hidden(canvas)
    torch.testing.assert_close(masked, dropped)
    assert not torch.allclose(masked, full, atol=1e-4)


def test_one_requests_kv_read_by_every_row_trains_as_a_copy_per_row(eagle3, make_eagle3_inputs):
    """A window of rounds at one request (core/canvas.py stack_rounds) passes the request's context
    K/V once, [1, H, L, D], with a mask per row: the logits and the weight gradients of the same
    context copied to every row."""
    one = make_eagle3_inputs(eagle3, batch=1, context=6)["canvas"]
    rows = make_eagle3_inputs(eagle3, batch=3, context=6, seed=1)["canvas"]
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    shared = replace(rows, past_kv=one.past_kv, past_mask=mask)
    copied = replace(
        rows,
        past_kv=[(k.expand(3, -1, -1, -1).clone(), v.expand(3, -1, -1, -1).clone()) for k, v in one.past_kv],
        past_mask=mask,
    )
    grads = []
    for canvas in (shared, copied):
        eagle3.zero_grad(set_to_none=True)
        logits = eagle3.canvas_logits(canvas)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        grads.append((logits.detach(), {n: p.grad.clone() for n, p in eagle3.trainable_named_parameters()}))
    eagle3.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grad, grads[1][1][name], rtol=1e-4, atol=1e-6)


def test_positions_past_a_rows_last_valid_one_are_skipped_and_change_nothing(eagle3, make_eagle3_inputs):
    """A stride's stacked rounds are mostly padding after each row's last valid position: the unroll
    runs step k only on the rows with a valid position at k or later. What it computes, and the
    weight gradients of a loss on the valid positions, are the full unroll's; the rest is zeros."""
    one = make_eagle3_inputs(eagle3, batch=1, context=6)["canvas"]
    rows = make_eagle3_inputs(eagle3, batch=4, context=6, seed=1)["canvas"]
    # Row 2 has no valid position; row 3 a gap (a target top-1 outside the draft vocabulary).
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]], dtype=torch.bool)
    past_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    trimmed = replace(rows, past_kv=one.past_kv, past_mask=past_mask, valid=valid)
    full = replace(trimmed, valid=torch.ones_like(valid))
    order, alive = eagle3._rows_by_need(trimmed)
    assert alive == [3, 3, 2, 2] and order is not None
    assert eagle3._rows_by_need(full) == (None, [4, 4, 4, 4])
    need = torch.tensor([2, 4, 0, 4])
    computed = torch.arange(4)[None] < need[:, None]
    results = []
    for canvas in (trimmed, full):
        eagle3.zero_grad(set_to_none=True)
        hidden = eagle3.canvas_logits(canvas)  # hidden @ lm_head.T: zeros where the hidden is
        (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden) * valid[..., None]).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in eagle3.trainable_named_parameters()}))
    eagle3.zero_grad(set_to_none=True)
    (short, short_grads), (long, long_grads) = results
    torch.testing.assert_close(short[computed], long[computed])
    assert short[~computed].abs().sum() == 0 and long[~computed].abs().sum() > 0
    for name, grad in short_grads.items():
        torch.testing.assert_close(grad, long_grads[name], rtol=1e-4, atol=1e-6)


def test_rows_at_several_requests_read_their_requests_context_once_and_are_trimmed(eagle3, make_eagle3_inputs):
    """A window at several requests (core/canvas.py stack_rounds) keeps one context K/V per request and
    names the one each row reads (`context_rows`): the rows are trimmed like one request's, and compute
    what the full unroll over a gathered copy per row computes, weight gradients included. Adapter hooks
    read one slot per canvas row: rows with slots run the full unroll."""
    contexts = make_eagle3_inputs(eagle3, batch=2, context=6)["canvas"].past_kv  # [2, H, 6, D] per layer
    rows = make_eagle3_inputs(eagle3, batch=5, context=6, seed=1)["canvas"]
    entry = [1, 0, 0, 1, 1]
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    past_mask = torch.tensor(
        [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1] * 6, [1, 1, 1, 0, 0, 0], [1] * 6], dtype=torch.bool
    )
    grouped = replace(rows, past_kv=contexts, past_mask=past_mask, valid=valid, context_rows=entry)
    grouped.validate()
    copied = replace(grouped, past_kv=[(k[entry].clone(), v[entry].clone()) for k, v in contexts], context_rows=None)
    full = replace(copied, valid=torch.ones_like(valid))
    order, alive = eagle3._rows_by_need(grouped)
    assert alive == [4, 3, 2, 2] and order == [1, 3, 0, 4, 2]
    assert eagle3._rows_by_need(full)[0] is None
    assert eagle3._rows_by_need(replace(grouped, slots=torch.arange(5)))[0] is None
    need = torch.tensor([2, 4, 0, 4, 1])
    computed = torch.arange(4)[None] < need[:, None]
    results = []
    for canvas in (grouped, copied, full):
        eagle3.zero_grad(set_to_none=True)
        hidden = eagle3.canvas_logits(canvas)  # hidden @ lm_head.T: zeros where the hidden is
        (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden) * valid[..., None]).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in eagle3.trainable_named_parameters()}))
    eagle3.zero_grad(set_to_none=True)
    (ours, our_grads), (theirs, _), (long, long_grads) = results
    torch.testing.assert_close(ours, theirs)  # the same trim over a gathered copy
    torch.testing.assert_close(ours[computed], long[computed])
    assert ours[~computed].abs().sum() == 0 and long[~computed].abs().sum() > 0
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, long_grads[name], rtol=1e-4, atol=1e-6)


def test_recycled_hidden_is_prenorm_unless_norm_output(tmp_path, llama_target, make_target_tensors, make_eagle3_inputs):
    embedding = make_target_tensors(llama_target)[0]
    path = write_tiny_eagle3(tmp_path / "e", llama_target)
    plain = load_drafter(path, target_embedding=embedding)
    canvas = make_eagle3_inputs(plain)["canvas"]
    with torch.no_grad():
        step = plain.draft_step(canvas.input_ids[:, 0], canvas.features, canvas.positions[:, 0], canvas.past_kv)
        assert not torch.allclose(step.aux, step.hidden, atol=1e-3)
        torch.testing.assert_close(plain.norm(step.aux), step.hidden)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, norm_output=True)))
    normed = load_drafter(path, target_embedding=embedding)
    with torch.no_grad():
        step = normed.draft_step(canvas.input_ids[:, 0], canvas.features, canvas.positions[:, 0], canvas.past_kv)
        torch.testing.assert_close(step.aux, step.hidden)
        # A different recycled hidden changes every later position, not the first.
        a, b = plain.canvas_hidden(canvas), normed.canvas_hidden(canvas)
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert not torch.allclose(a[:, 1:], b[:, 1:], atol=1e-4)


def test_two_layer_drafter_unrolls_and_trains(tmp_path, llama_target, make_target_tensors, make_eagle3_inputs):
    path = write_tiny_eagle3(tmp_path / "e2", llama_target, layout="layers.0", num_layers=2)
    drafter = load_drafter(path, target_embedding=make_target_tensors(llama_target)[0], target_config=llama_target)
    assert drafter.layers[1].self_attn.q_proj.in_features == 64 and drafter.layers[1].input_layernorm is None
    canvas = make_eagle3_inputs(drafter)["canvas"]
    assert len(canvas.past_kv) == 2
    with torch.no_grad():
        torch.testing.assert_close(drafter.canvas_hidden(canvas), _stepwise(drafter, canvas))
    drafter.canvas_logits(canvas).square().mean().backward()
    for name, param in drafter.trainable_named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_teacher_probs_on_draft_vocab(eagle3, make_eagle3_inputs):
    canvas = make_eagle3_inputs(eagle3)["canvas"]
    ids = eagle3.draft_to_target_ids()
    outside = torch.nonzero(~eagle3.t2d).flatten()
    logits = canvas.target_logits.clone()
    logits[0, 0, ids[5]] = 50.0  # top-1 inside the draft vocab
    logits[0, 1, outside[0]] = 50.0  # top-1 outside: the position is dropped
    probs, mask = eagle3.teacher_probs(replace(canvas, target_logits=logits))
    assert probs.shape == (2, 4, eagle3.cfg.draft_vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4))
    full = torch.softmax(logits, dim=-1)[..., ids]
    torch.testing.assert_close(probs, full / full.sum(-1, keepdim=True))
    assert bool(mask[0, 0]) and not bool(mask[0, 1])
    torch.testing.assert_close(mask, eagle3.t2d[logits.argmax(-1)])
    assert int(probs[0, 0].argmax()) == 5


def test_a_canvas_captured_at_the_draft_vocab_gives_the_same_teacher_on_the_positions_it_keeps(
    eagle3, make_eagle3_inputs
):
    """Capture's reduction (core/canvas.py TeacherVocab): the logits at the draft ids only, and the
    positions whose target top-1 lies outside them out of `valid`. The teacher and the loss's mask
    are those of the whole-vocabulary canvas; a canvas of another vocabulary is refused."""
    canvas = make_eagle3_inputs(eagle3)["canvas"]
    outside = torch.nonzero(~eagle3.t2d).flatten()
    logits = canvas.target_logits.clone()
    logits[1, 2, outside[0]] = 50.0  # top-1 outside the draft vocabulary
    logits[0, 3] = float("-inf")  # a row without mass on the draft ids (masked vocabulary)
    logits[0, 3, outside[1]] = 0.0
    full = replace(canvas, target_logits=logits)
    vocab = eagle3.teacher_vocab("cpu")
    assert vocab is not None and vocab.ids.shape == (eagle3.cfg.draft_vocab_size,)
    flat = logits.reshape(-1, logits.shape[-1])
    kept, top1_covered = vocab.gather(flat, torch.arange(flat.shape[0]))
    reduced = replace(
        canvas,
        target_logits=kept.view(2, 4, -1),
        valid=canvas.valid & top1_covered.view(2, 4),
        teacher_ids=vocab.ids,
    )
    reduced.validate()
    probs, mask = eagle3.teacher_probs(reduced)
    want_probs, want_mask = eagle3.teacher_probs(full)
    assert torch.equal(reduced.valid & mask, full.valid & want_mask)
    assert not bool(reduced.valid[1, 2]) and not bool(reduced.valid[0, 3])
    torch.testing.assert_close(probs, want_probs)
    assert not torch.isnan(probs).any() and float(probs[0, 3].abs().sum()) == 0.0
    other = replace(reduced, teacher_ids=vocab.ids.flip(0))
    with pytest.raises(ValueError, match="another vocabulary"):
        eagle3.teacher_probs(other)


def test_an_update_on_stacked_rounds_captured_at_the_draft_vocab_trains_the_same_weights(eagle3, make_eagle3_inputs):
    """A stride's update (three rounds stacked, core/canvas.py stack_rounds) on canvases captured at the
    draft vocabulary takes the same step as on whole-vocabulary canvases: the saving is in memory and
    copies only."""
    vocab = eagle3.teacher_vocab("cpu")

    def reduced(canvas: Canvas) -> Canvas:
        b, c, v = canvas.target_logits.shape
        flat = canvas.target_logits.reshape(b * c, v)
        logits, top1_covered = vocab.gather(flat, torch.arange(b * c))
        return replace(
            canvas,
            target_logits=logits.view(b, c, -1),
            valid=canvas.valid & top1_covered.view(b, c),
            teacher_ids=vocab.ids,
        )

    rounds = []
    for seed in range(3):
        canvas = replace(make_eagle3_inputs(eagle3, seed=seed)["canvas"], request_ids=["a", "b"])
        canvas.target_logits[:, :2, vocab.ids[seed]] += 8.0  # some top-1s inside the draft vocabulary
        rounds.append(
            canvas if seed == 2 else replace(canvas, past_kv=None, past_mask=None, positions=canvas.positions - 2)
        )
    stacked = {
        "full": stack_rounds(rounds[:2], rounds[2]),
        "draft": stack_rounds([reduced(c) for c in rounds[:2]], reduced(rounds[2])),
    }
    assert (
        stacked["draft"].target_logits.shape[-1]
        == eagle3.cfg.draft_vocab_size
        < stacked["full"].target_logits.shape[-1]
    )
    kept = stacked["draft"].valid
    assert kept.any() and not kept.all()
    trained = {}
    for name, canvas in stacked.items():
        drafter = copy.deepcopy(eagle3)
        distiller = Distiller(drafter, TTSConfig(update_stride=1, lr=1e-2, reg_lambda=0.0, log_interval=0))
        assert distiller.observe(canvas, owned=True)
        distiller.barrier()
        assert distiller.stats.num_updates == 1
        trained[name] = {n: p.detach().clone() for n, p in drafter.trainable_named_parameters()}
    before = dict(eagle3.trainable_named_parameters())
    for n, p in trained["draft"].items():  # up to float order: the two trim different rows (their valid differ)
        torch.testing.assert_close(p, trained["full"][n], rtol=1e-4, atol=5e-5)
    assert any(not torch.equal(p, before[n]) for n, p in trained["draft"].items())


def test_draft_vocab_maps_are_consistent(tmp_path, eagle3, llama_target, make_target_tensors):
    ids = eagle3.draft_to_target_ids()
    assert eagle3.d2t.dtype == torch.int64 and eagle3.t2d.dtype == torch.bool
    assert bool(eagle3.t2d[ids].all()) and int(eagle3.t2d.sum()) == eagle3.cfg.draft_vocab_size
    assert bool((ids[1:] > ids[:-1]).all())  # sorted, distinct target ids
    # A checkpoint without t2d gets it rebuilt from d2t; a d2t leaving t2d is rejected.
    path = write_tiny_eagle3(tmp_path / "e", llama_target)
    tensors = load_checkpoint_tensors(path)
    drafter = Eagle3Drafter(eagle3.cfg)
    drafter.load_checkpoint_weights({k: v for k, v in tensors.items() if k != "t2d"})
    assert torch.equal(drafter.t2d, tensors["t2d"])
    bad_t2d = tensors["t2d"].clone()
    bad_t2d[int(tensors["d2t"][0])] = False
    with pytest.raises(ValueError, match="d2t/t2d"):
        Eagle3Drafter(eagle3.cfg).load_checkpoint_weights(dict(tensors, t2d=bad_t2d))


def test_default_position_weights(eagle3):
    torch.testing.assert_close(eagle3.default_position_weights(4), torch.tensor([1.0, 0.8, 0.64, 0.512]))


@pytest.mark.parametrize(
    "override, message",
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1], "use_aux_hidden_state": True}}, "skip fc"),
    ],
)
def test_unsupported_flags_raise(tmp_path, llama_target, make_target_tensors, override, message):
    path = write_tiny_eagle3(tmp_path / "e", llama_target)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, **override)))
    with pytest.raises(UnsupportedDrafterConfigError, match=message):
        load_drafter(path, target_embedding=make_target_tensors(llama_target)[0])


def test_norm_before_fc_and_fc_norm_are_loaded_and_trained(
    tmp_path, llama_target, make_target_tensors, make_eagle3_inputs
):
    path = write_tiny_eagle3(tmp_path / "e", llama_target)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eagle_config"]["norm_before_fc"] = True
    cfg["fc_norm"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["input_norm.weight"] = torch.full((192,), 2.0)
    for i, legacy in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
        tensors[f"{legacy}.weight"] = torch.full((64,), 1.0 + i)
    save_file(tensors, str(path / "model.safetensors"))
    drafter = load_drafter(path, target_embedding=make_target_tensors(llama_target)[0])
    assert torch.equal(drafter.input_norm.weight, torch.full((192,), 2.0))
    assert torch.equal(drafter.fc_norm[2].weight, torch.full((64,), 3.0))
    canvas = make_eagle3_inputs(drafter)["canvas"]
    drafter.canvas_hidden(canvas).sum().backward()
    assert drafter.input_norm.weight.grad is not None and drafter.fc_norm[1].weight.grad is not None

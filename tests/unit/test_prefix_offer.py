"""The engine side of the reverse pull: a decode worker pins the prefix it offers (eviction under a small budget
leaves its pages and checkpoint alone while the pin lives), and a prefill worker that receives those bytes into a
reservation starts the prompt from them, computing only the rest, with the same output as without any cache."""

import torch
from test_prefix_cache import GREEDY, PAGE, assert_cached_baseline, conversation, core, run_waves, tokens


def pin(engine, prompt):
    """What a decode worker offers for this prompt (Engine.pin_prefix): the pinned prefix and its regions."""
    pinned = engine.prefix_cache.pin(prompt)
    return pinned, engine.prefix_cache.regions(pinned)


def test_an_offered_prefix_survives_eviction_while_pinned(hf_checkpoints):
    engine = core(hf_checkpoints["qwen3_5"], True, prefix_cache_pages=10, prefix_cache_checkpoints=3)
    first = tokens(13, 1)
    [reply] = conversation(engine, [first], GREEDY)
    history = first + reply
    pinned, regions = pin(engine, history + tokens(6, 2))
    before = [r.tensor.clone() for r in regions]
    assert pinned.num_tokens == len(history) - 1  # all but the last reply token (never computed)
    evicted = engine.stats.checkpoints_evicted
    for i in range(4):  # other conversations that fill the small budget many times over
        conversation(engine, [tokens(14, 10 + i), tokens(5, 20 + i)], GREEDY)
    assert engine.stats.checkpoints_evicted > evicted  # eviction ran, and took others only
    assert [r.tensor for r in regions] and all(torch.equal(r.tensor, b) for r, b in zip(regions, before))
    again, _ = pin(engine, history + tokens(6, 2))
    assert again.num_tokens == pinned.num_tokens and again.pages == pinned.pages
    engine.prefix_cache.unpin(again)
    engine.prefix_cache.unpin(pinned)
    for i in range(4):  # unpinned, it is evicted like anything else
        conversation(engine, [tokens(14, 30 + i), tokens(5, 40 + i)], GREEDY)
    assert engine.prefix_cache.cached_tokens(history + tokens(6, 2)) == 0
    assert_cached_baseline(engine)


def test_a_prompt_started_from_pulled_state_equals_it_computed(hf_checkpoints):
    model = hf_checkpoints["qwen3_5"]
    holder = core(model, True)
    first = tokens(13, 3)
    [reply] = conversation(holder, [first], GREEDY)
    prompt = first + reply + tokens(9, 4)
    [expected] = run_waves(core(model, False), [[prompt]], GREEDY).values()

    puller = core(model, True)
    pinned, regions = pin(holder, prompt)
    reservation = puller.reservations.reserve(pinned.num_tokens)
    src = torch.cat([r.tensor for r in regions])  # what the side channel moves: the bytes, in hand-off order
    assert src.numel() == sum(r.tensor.numel() for r in reservation.regions)
    offset = 0
    for r in reservation.regions:
        r.tensor.copy_(src[offset : offset + r.tensor.numel()])
        offset += r.tensor.numel()
    holder.prefix_cache.unpin(pinned)

    out = []
    puller.submit_pulled(
        puller.make_request(prompt, GREEDY, "pulled"),
        pinned.num_tokens,
        reservation,
        lambda o: out.extend(o.new_token_ids),
    )
    while puller.has_work or not puller._commands.empty():
        puller.dispatch(puller.process_commands())
        puller.dispatch(puller.step())
    assert out == expected
    assert puller.stats.prompt_tokens == len(prompt) - pinned.num_tokens  # only the rest was computed
    assert puller.stats.pulled_prefix_tokens == pinned.num_tokens == len(first) + len(reply) - 1
    # the pulled prefix joined the puller's own cache: the same prompt now hits there
    assert puller.prefix_cache.cached_tokens(prompt) >= pinned.num_tokens // PAGE * PAGE
    assert_cached_baseline(puller)
    assert_cached_baseline(holder)

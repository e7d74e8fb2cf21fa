"""The attending EAGLE head: the keys and values a drafter keeps per row (the prompt's pairs, each
call's kept pairs, a chain's own drafts) give the drafts the head gives a whole sequence at once, as it
trains; its files load back; greedy output stays greedy decoding's (``test_exactness``)."""

import pytest
import torch

import layerleap
from layerleap.drafters import medusa_transfer as drafters
from layerleap.drafters.eagle import EagleChains

from tiny_models import naive_greedy, random_model


def _head(model, seed=0, scale=0.3):
    d = drafters.new_drafter(model, "eagle", attention=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return d.eval().requires_grad_(False)


def _offline_chain(model, head, seq: list[int], steps: int) -> list[int]:
    """The head's chain after ``seq`` (its last token the root) from the whole sequence at once:
    each step's pair at the next position attends to every earlier pair (``EagleHead.step``)."""
    ids = torch.tensor([seq])
    n = len(seq)
    with torch.no_grad():
        h = model.run_layers(model.embed(ids), 0, model.config.n_layers, torch.arange(n).unsqueeze(0))
        z = model.final_norm(h)[0, :-1]  # [n - 1, D]: the states before each token after the first
        x = list(seq[1:])
        chain = []
        for _ in range(steps):
            s = head.step(z.unsqueeze(0), torch.tensor([x]))[0, -1]
            zs = model.final_norm(s)
            d = int(model.unembed(zs).argmax())
            chain.append(d)
            z, x = torch.cat([z, zs.unsqueeze(0)]), x + [d]
    return chain


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("steps", [1, 3])
def test_decoding_drafts_equal_the_whole_sequence_s(monkeypatch, seed, steps):
    model = random_model("llama-gqa-tied", seed=seed, scale=2.0)
    head = _head(model, seed)
    seen = []
    real = EagleChains.draft

    def spy(self, states, roots, lengths, rows=None):
        chains, siblings = real(self, states, roots, lengths, rows)
        if not roots:
            return chains, siblings
        seq = self.run.prompts[0] + self.run.out[0]
        assert seq[-1] == roots[0]
        seen.append((seq, chains[0]))
        return chains, siblings

    monkeypatch.setattr(EagleChains, "draft", spy)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6][: 3 + seed]
    r = layerleap.generate(
        model, prompt, "eagle", 24, stop_at_eos=False, eagle_head=head, draft_len=steps, draft_vocab="full"
    )
    assert r.token_ids == naive_greedy(model, prompt, 24)
    assert len(seen) >= 4
    for seq, chain in seen:
        want = _offline_chain(model, head, seq, len(chain))
        assert chain == want, (seq, chain, want)


def test_batch_rows_draft_as_alone(monkeypatch):
    model = random_model("llama-gqa-tied", seed=4, scale=2.0)
    head = _head(model, 4)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3]]
    alone = [
        layerleap.generate(model, p, "eagle", 16, stop_at_eos=False, eagle_head=head, draft_len=2) for p in prompts
    ]
    both = layerleap.generate(model, prompts, "eagle", 16, stop_at_eos=False, eagle_head=head, draft_len=2)
    for a, b, p in zip(alone, both, prompts):
        assert b.token_ids == a.token_ids == naive_greedy(model, p, 16)
        assert b.stats["accepted"] == a.stats["accepted"]


def test_attending_head_file_round_trip(tmp_path):
    model = random_model("llama-gqa-tied", seed=5)
    head = _head(model, 5)
    path = drafters.save_drafter(head, tmp_path / "e.safetensors", dtype=torch.float32)
    back = drafters.load_drafter(model, path, "eagle")
    assert back.attention and back.config() == head.config()
    z, x = torch.randn(1, 6, model.config.hidden_size), torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert torch.equal(back.step(z, x), head.step(z, x))


def test_training_an_attending_head_from_one_without(tmp_path):
    """``--attention`` with ``--init`` of a head without it: the block starts from the file and the
    attention at zero output (the same states at step 0), the loss falls, and the trained head decodes
    greedily token for token."""
    from tiny_models import naive_greedy

    from layerleap.train import medusa_transfer as train_drafters
    from layerleap.train.medusa_transfer import TrainConfig, TrainError

    model = random_model("llama-mha-untied", seed=2)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, model.config.vocab_size, (7,), generator=g)
    chunks = [[int(base[(s + i) % 7]) for i in range(12)] for s in range(7)]
    plain = drafters.new_drafter(model, "eagle")
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    init = drafters.save_drafter(plain, tmp_path / "plain.safetensors", dtype=torch.float32)
    cfg = TrainConfig(
        kind="eagle", steps_ahead=2, train_steps=30, seq_len=12, batch_size=2, lr=3e-2, warmup=2, attention=True
    )
    grown = drafters.new_drafter(model, "eagle", attention=True)
    train_drafters.start_from(grown, init)
    z, x = torch.randn(1, 5, model.config.hidden_size), torch.tensor([chunks[0][:5]])
    assert torch.equal(grown.step(z, x), plain.step(z, x))
    before = train_drafters.eval_loss(model, grown, chunks)
    report = train_drafters.train(
        model,
        tmp_path / "attn.safetensors",
        TrainConfig(**{**cfg.__dict__, "init": str(init)}),
        chunks=chunks,
        progress=False,
    )
    trained = drafters.load_drafter(model, report["out"], "eagle")
    assert trained.attention
    assert train_drafters.eval_loss(model, trained, chunks) < 0.7 * before
    prompt = chunks[0][:5]
    r = layerleap.generate(model, prompt, "eagle", 10, stop_at_eos=False, draft_len=3, eagle_head=trained)
    assert r.token_ids == naive_greedy(model, prompt, 10)
    with pytest.raises(TrainError, match="--attention is for train eagle"):
        train_drafters.check_config(TrainConfig(kind="medusa", attention=True), model)

"""TRL's real GRPOTrainer, a few steps on a tiny randomly initialised model built from a
transformers config (no download), dumping through a subclass as docs/integrations.md shows.

On a CPU there is no vLLM, and transformers' generate gives TRL no rollout log-probs
(grpo_trainer.py l.1877); TRL's `rollout_func` is its hook for another rollout engine, and
here it is one: the same model sampling with `generate`, returning the sampled tokens'
log-probs as an engine does. num_iterations=2 makes TRL recompute old_per_token_logps
(l.2562-2564), as it does with vLLM's importance sampling on.
"""

from __future__ import annotations

import numpy as np
import torch

import iscore
from iscore.dump.writer import DumpWriter
from tests.batches import read_dump
from tests.integrations.conftest import framework

INSTALL = "pip install '.[integrations]'"
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]


def _tokenizer():
    transformers = framework("transformers", INSTALL)
    tokenizers = framework("tokenizers", INSTALL)
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _model():
    transformers = framework("transformers", INSTALL)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.LlamaForCausalLM(config)


def _rollout(prompts, trainer):
    """A rollout engine: sample with the policy and return the sampled tokens' log-probs."""
    tokenizer, model = trainer.processing_class, trainer.model
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    # In train mode with TRL's gradient checkpointing, generate runs without its KV cache and
    # its logits drift from a full forward (~0.05 nats here); an engine serves in eval mode.
    training = model.training
    model.eval()
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            generated = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=True,
                max_new_tokens=6,
                min_new_tokens=2,
                output_logits=True,  # raw: `scores` are renormalized by top-k, min length
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            completion = generated.sequences[0, len(ids) :].tolist()
            scores = torch.stack(generated.logits)[:, 0].log_softmax(-1)
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(scores[torch.arange(len(completion)), completion].tolist())
    model.train(training)
    return out


def test_the_grpo_trainer_dumps_every_step(tmp_path, monkeypatch) -> None:
    trl = framework("trl", INSTALL)
    datasets = framework("datasets", INSTALL)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    writer = DumpWriter(tmp_path / "dump", framework="trl", rank=0)
    seen = []

    class DumpingGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            writer.add_batch(output, step=self.state.global_step)
            seen.append((self.state.global_step, {k: v for k, v in output.items()}))
            return output

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        num_iterations=2,
        max_steps=4,
        learning_rate=1e-3,
        use_cpu=True,
        bf16=False,  # TRL trains in bf16 by default: a real mismatch, kept out here
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    prompts = [" ".join(f"w{(7 * i + j) % 61}" for j in range(3)) for i in range(8)]
    trainer = DumpingGRPOTrainer(
        model=_model(),
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=_tokenizer(),
        rollout_func=_rollout,
    )
    trainer.train()
    writer.close()

    assert [step for step, _ in seen] == [0, 2], "one generation per two optimizer steps"
    table = read_dump(tmp_path / "dump")
    assert sorted(set(table["step"].to_pylist())) == [0, 2]
    for step, output in seen:
        rows = table.filter(table["step"].to_numpy() == step)
        mask = output["completion_mask"].bool()
        for i, got in enumerate(rows["rollout_logprob"].to_pylist()):
            want = output["sampling_per_token_logps"][i][mask[i]].numpy()
            np.testing.assert_array_equal(np.asarray(got, np.float32), want)
        for i, got in enumerate(rows["train_logprob"].to_pylist()):
            np.testing.assert_array_equal(
                np.asarray(got, np.float32), output["old_per_token_logps"][i][mask[i]].numpy()
            )
        for i, got in enumerate(rows["token_id"].to_pylist()):
            assert got == output["completion_ids"][i][mask[i]].tolist()
        np.testing.assert_array_equal(
            rows["advantage"].to_numpy(), output["advantages"].numpy().astype(np.float32)
        )
    batch = iscore.load(tmp_path / "dump")
    assert batch.num_sequences == table.num_rows == 8
    assert 0 < float((batch.train - batch.rollout).abs().max()) < 1e-3, "same model, CPU fp32"

"""What a model trained on the short-answer task (configs/local-tiny-grpo.yaml) answers, class by class: its
greedy first token for each distinct prompt of the dataset, scored with the task's reward. A model that reads
the class answers differently per class and beats the best constant answer (the highest reward one fixed
coordinate token earns over the dataset, printed beside it); one that learned only where answers tend to be
does not.

Usage: rmsft local configs/local-tiny-grpo.yaml
       python benchmarks/grpo_answers.py .rmsft/checkpoints-grpo/export .rmsft/tiny-answers.jsonl [--width 125]
       (--model .rmsft/tiny-model: the same for the untrained model)
Ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a Hugging Face model folder (the run's export, or the untrained model)")
    ap.add_argument("data", help="the task's records (JSONL)")
    ap.add_argument("--width", type=float, default=125.0, help="the reward's width (as in the job's rewards)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.core.codec import coord_token_text
    from rmsft_dev.synthetic import CoordAnswerReward, leading_bin

    records = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    prompts = {r["messages"][0]["content"]: r["answer"] for r in records}  # distinct prompts, their answer
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    reward = CoordAnswerReward(width=args.width)

    def score(answer: str, text: str) -> float:
        return reward(_Input(answer, text))

    rows = []
    for content, answer in prompts.items():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        first = int(logits.argmax())
        text = tok.decode([first])
        p = float(torch.softmax(logits.float(), -1)[first])
        rows.append((content, answer, text, p, score(answer, text)))
    print(f"{'prompt':58s} {'answer':>15s} {'greedy':>15s} {'p':>6s} {'reward':>6s}")
    for content, answer, text, p, r in rows:
        print(f"{content[:58]:58s} {answer:>15s} {text:>15s} {p:6.3f} {r:6.3f}")
    # The best constant: every coordinate token as the one answer to every record.
    targets = [r["answer"] for r in records]
    best = max(sum(score(a, coord_token_text(b)) for a in targets) / len(targets) for b in range(1000))
    greedy = {p[0]: p[4] for p in rows}
    mean = sum(greedy[r["messages"][0]["content"]] for r in records) / len(records)
    distinct = len({leading_bin(t) for _, _, t, _, _ in rows})
    exact = sum(r == 1.0 for *_, r in rows)
    print(
        f"RESULT classes={len(rows)} distinct_answers={distinct} exact={exact} greedy_reward={mean:.3f} "
        f"best_constant={best:.3f}"
    )


class _Input:
    """The two fields CoordAnswerReward reads."""

    def __init__(self, answer: str, text: str) -> None:
        self.answer, self.text, self.record = answer, text, None


if __name__ == "__main__":
    main()

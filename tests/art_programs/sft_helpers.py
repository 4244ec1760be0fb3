"""ART's own SFT helpers (as its train-sft skill uses them) on an art-sky backend, unchanged but for the line marked
BACKEND: `train_sft_from_file` with its default linear schedule, `create_sft_dataset_iterator` + `model.train_sft`
with the cosine and constant schedules. ART's schedules end at a learning rate of 0.0. Then one schedule with a
negative rate, which must be refused with nothing trained. Python >= 3.12, with the real openpipe-art. It prints
what it saw as JSON (the last line) for tests/test_openpipe_art.py.
"""

import asyncio
import json
import sys

import art
from art.utils.sft import create_sft_dataset_iterator, train_sft_from_file

import art_sky

PROJECT = "art-sft"


def conversation(a: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Answer with digits."},
            {"role": "user", "content": f"What is {a} + {a}?"},
            {"role": "assistant", "content": str(2 * a)},
        ]
    }


async def main() -> None:
    seen: dict = {}
    backend = art_sky.LocalBackend()  # BACKEND (the test gives it path="elsewhere")
    model = art.TrainableModel(name="sft", run_name="sft-1", project=PROJECT, base_model="art-sky/tiny")
    await model.register(backend)
    seen["base_path"] = model.base_path

    with open("data.jsonl", "w") as f:
        f.writelines(json.dumps(conversation(a)) + "\n" for a in range(4))
    await train_sft_from_file(model, "data.jsonl", batch_size=2, peak_lr=1e-3)  # linear: [1e-3, 0.0]
    seen["after_file"] = await model.get_step()

    trajectories = [art.Trajectory(messages_and_choices=conversation(a)["messages"], reward=0.0) for a in range(4)]
    rates = []
    for schedule in ("cosine", "constant"):
        for chunk in create_sft_dataset_iterator(
            trajectories, chunk_size=1, batch_size=2, peak_lr=1e-3, schedule_type=schedule, show_progress=False
        ):
            rates.append(chunk.config.learning_rate)
            await model.train_sft(chunk.trajectories, chunk.config)
    seen["chunk_rates"] = rates
    seen["after_iterator"] = await model.get_step()

    try:
        await model.train_sft(trajectories, art.TrainSFTConfig(learning_rate=[1e-3, -1e-4], batch_size=2))
        seen["negative"] = "trained"
    except Exception as exc:  # what the user sees is what the test checks
        seen["negative"] = f"{type(exc).__name__}: {exc}"
    seen["after_negative"] = await model.get_step()
    await backend.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)

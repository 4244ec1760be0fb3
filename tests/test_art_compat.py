"""ART compatibility (art_sky/art_compat), piece by piece, without the ART package: `backend.train`'s keywords per
release line, a model's run and LoRA, the release check, capture-style trajectories, `after_each`, and on the real
in-process server what ART 0.5.20+'s protocol asks of it: leases, steps without a checkpoint, run lineages, SFT
turn by turn. tests/test_openpipe_art.py runs real ART programs at both ends of the supported range.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import types

import pytest
from chat_templates import template_model
from conftest import app_client, train_lines
from openai.types.chat import ChatCompletion

import art_sky as art
from art_sky.art_compat import releases
from art_sky.art_compat.capture import legacy
from art_sky.art_compat.models import chat_template_kwargs, model_config, sft_settings
from art_sky.art_compat.training import KEYWORDS, train_options
from art_sky.checkpoints import CheckpointDir
from art_sky.errors import ConfigError
from art_sky.layout import OPTIMIZER_STATE
from art_sky.settings import Settings
from art_sky.wire import ModelConfig, TrainConfig


# -- backend.train's keywords ----------------------------------------------------------------------------------
def test_keywords_that_cannot_change_training_are_accepted_at_any_valid_value():
    config, options = train_options(
        None,
        {
            "optimizer_save_interval": 3,
            "final_training_step": 7,
            "logprob_calculation_chunk_size": 512,
            "packed_sequence_length": 2048,
            "kl_penalty_reference_step": 0,
            "save_checkpoint": False,
        },
    )
    assert config == train_options(None, {})[0] and options.save_checkpoint is False


def test_keywords_map_onto_the_trainer_with_arts_meaning():
    config, _ = train_options(
        None,
        {
            "importance_sampling_level": "geometric_average",
            "kl_penalty_coef": 0.2,
            "kl_penalty_source": "sample",
            "precalculate_logprobs": True,
            "truncated_importance_sampling": 2.0,
        },
    )
    assert (
        config.importance_sampling_level,
        config.kl_penalty_source,
        config.old_logprobs,
        config.truncated_importance_sampling,
    ) == ("geometric_average", "sample", "trainer", 2.0)
    assert train_options(None, {"grad_accumulation_sequences": 4})[0].grad_accumulation_sequences == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"adam_params": {"beta1": 0.8}},
            r"adam_params=\{'beta1': 0.8\}.*ART 0\.5\.18 added adam_params: leave it at None",
        ),
        ({"kl_penalty_reference_step": 3}, "kl_penalty_reference_step=3"),
        ({"optimizer_save_interval": 0}, r"optimizer_save_interval=0\): a positive integer"),
        ({"loss_fn": "dro"}, r"loss_fn='dro'\): Input should be 'ppo' or 'cispo'"),
        (
            {"grad_accumulation_sequences": 2, "truncated_importance_sampling": 2.0},
            "grad_accumulation_sequences cannot",
        ),
    ],
)
def test_values_art_sky_cannot_honour_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        train_options(None, kwargs)


def test_a_misspelt_keyword_is_a_type_error_listing_the_accepted_ones():
    with pytest.raises(TypeError, match=r"'learning_rte'.*grad_accumulation_sequences.*save_checkpoint"):
        train_options(None, {"learning_rte": 1e-5})


def test_every_keyword_says_which_release_added_it():
    assert {keyword.since for keyword in KEYWORDS.values()} <= set(releases.LINES)
    assert KEYWORDS["kl_penalty_source"].since == "0.5.20" and KEYWORDS["save_checkpoint"].since == "0.5.18"


def test_every_keyword_that_shapes_the_loss_reaches_the_trainer():
    """A "config" keyword is a TrainConfig field of its name, or one of the three translated: none is dropped."""
    for name, keyword in KEYWORDS.items():
        if keyword.role == "config" and name not in TrainConfig.model_fields:
            assert name in ("normalize_advantages", "precalculate_logprobs", "kl_penalty_reference_step"), name
    assert train_options(None, {"kl_penalty_coef": 0.3})[0].kl_penalty_coef == 0.3


# -- a model's run, LoRA and chat template arguments -------------------------------------------------------------
class _ArtModel:
    """The fields art-sky reads from an `art.TrainableModel` (0.5.20+)."""

    def __init__(self, lora_config=None, internal=None, extra_body=None):
        self.config, self.lora_config, self._internal_config = {"user": "config"}, lora_config, internal
        self._extra_body = extra_body

    def _default_chat_completion_extra_body(self):
        return self._extra_body


def test_lora_config_sets_the_lora():
    config = model_config(
        _ArtModel(
            lora_config={
                "rank": 4,
                "alpha": 8,
                "dropout": 0.1,
                "bias": "none",
                "max_seq_length": 1024,
                "use_gradient_checkpointing": "unsloth",
            }
        )
    )
    assert config == ModelConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.1, max_seq_length=1024)
    with pytest.raises(ConfigError, match=r"lora_config\['use_rslora'\]=True is not supported.*leave it at False"):
        model_config(_ArtModel(lora_config={"use_rslora": True}))
    with pytest.raises(ConfigError, match=r"_internal_config\['rollout_weight_update_mode'\]='in_flight_lora'"):
        model_config(_ArtModel(internal={"rollout_weight_update_mode": "in_flight_lora"}))
    assert (
        model_config(
            art.TrainableModel(name="m", project="p", base_model="art-sky/tiny", lora_config=art.dev.LoRAConfig(rank=2))
        ).lora_rank
        == 2
    )


def test_the_chat_template_arguments_are_what_the_models_client_sends():
    sent = {"return_token_ids": True, "chat_template_kwargs": {"preserve_thinking": True, "enable_thinking": False}}
    assert chat_template_kwargs(_ArtModel(extra_body=sent)) == {"preserve_thinking": True, "enable_thinking": False}
    assert chat_template_kwargs(art.TrainableModel(name="m", project="p", base_model="b")) is None


def test_sft_takes_the_config_art_sends():
    config = types.SimpleNamespace(batch_size="auto", learning_rate=[1e-4, 1e-5], assistant_turns="last")
    assert sft_settings(config, {"metric_logging": {"enabled": True, "target_training_step": 3}}) == (
        2,
        [1e-4, 1e-5],
        "last",
    )
    with pytest.raises(ConfigError, match=r"\['precision'\]"):
        sft_settings(config, {"precision": "fp8"})


# -- the release check at register() -----------------------------------------------------------------------------
def test_a_release_outside_the_range_is_a_warning_and_a_protocol_art_sky_lacks_a_refusal(monkeypatch, caplog):
    model = types.SimpleNamespace()
    monkeypatch.setattr(releases, "is_art_object", lambda obj: True)
    monkeypatch.setattr(releases, "_stand_in_for_arts_local_backend", lambda: None)
    backend = art.Backend(base_url="http://x", api_key="k")
    monkeypatch.setattr(releases, "installed", lambda: "0.6.0")
    monkeypatch.setattr(releases, "_protocol_methods", lambda: {"register", "exact_adapter_lease", "train"})
    with caplog.at_level(logging.WARNING, "art_sky"):
        releases.check(backend, model)
    assert (
        f"openpipe-art 0.6.0 is outside the range art-sky is tested with ({releases.OLDEST} to "
        f"{releases.NEWEST})" in caplog.text
    )
    monkeypatch.setattr(releases, "_protocol_methods", lambda: {"register", "stream_rollouts"})
    with pytest.raises(ConfigError, match=r"asks for stream_rollouts.*supports ART 0\.5\.18 to 0\.5\.23"):
        releases.check(backend, model)


# -- capture-style trajectories (ART's Trajectory.exchanges) -----------------------------------------------------
def _completion(text, prompt, sampled, model="m@1"):
    return ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text},
                    "token_ids": sampled,
                }
            ],
        }
    )


def _captured(*calls, **kinds):
    exchanges = types.SimpleNamespace(
        **({"completions": [], "responses": [], "messages": []} | kinds),
        chat_completions=[types.SimpleNamespace(request=request, response=response) for request, response in calls],
    )
    return types.SimpleNamespace(
        exchanges=exchanges,
        reward=0.5,
        metrics={"m": 1.0},
        metadata={},
        logs=[],
        initial_policy_version=1,
        final_policy_version=1,
    )


def test_captured_exchanges_become_conversations_their_turns_in_order():
    user = {"role": "user", "content": "a"}
    first = _completion("x", [1, 2], [3])
    second_request = {
        "messages": [user, {"role": "assistant", "content": "x", "refusal": None}, {"role": "user", "content": "b"}],
        "chat_template_kwargs": {"preserve_thinking": True},
    }
    aside = {"messages": [{"role": "user", "content": "summarise"}], "tools": [{"type": "function"}]}
    converted = legacy(
        _captured(
            ({"messages": [user]}, first),
            (second_request, _completion("y", [1, 2, 3, 4], [5])),
            (aside, _completion("z", [9], [8])),
        )
    )
    items = converted.messages_and_choices
    assert [getattr(i, "message", i).get("content") if isinstance(i, dict) else i.message.content for i in items] == [
        "a",
        "x",
        "b",
        "y",
    ]  # one conversation: the second request continues the first
    assert items[3].model_extra["prompt_token_ids"] == [1, 2, 3, 4]
    assert [h.messages_and_choices[-1].message.content for h in converted.additional_histories] == ["z"]
    assert converted.additional_histories[0].tools == [{"type": "function"}]
    assert (converted.reward, converted.metrics, converted.initial_policy_version) == (0.5, {"m": 1.0}, 1)
    with pytest.raises(
        ConfigError, match="captured /v1/responses exchanges: art-sky serves and trains chat completions"
    ):
        legacy(_captured(responses=[object()]))


# -- art-sky's gather_trajectory_groups(after_each=...), as ART's ------------------------------------------------
async def test_after_each_replaces_drops_and_splits_groups_as_arts_does():
    def group(*rewards):
        return art.TrajectoryGroup(
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=r) for r in rewards
        )

    async def rescore(g):
        if not g.trajectories:  # every rollout failed
            return g
        if g.trajectories[0].reward == 0:
            return None
        if g.trajectories[0].reward == 2:
            return [group(5, 6), group(7, 8)]
        return art.TrajectoryGroup([t.model_copy(update={"reward": t.reward * 10}) for t in g.trajectories])

    async def fails():
        raise ValueError("boom")

    kept = await art.gather_trajectory_groups(
        [group(1, 1.5), group(0, 0), group(2, 2), art.TrajectoryGroup([fails()])],
        after_each=rescore,
        pbar_desc=None,
        max_exceptions=1,
    )
    assert [[t.reward for t in g.trajectories] for g in kept] == [[10, 15], [5, 6], [7, 8], []]
    with pytest.raises(TypeError, match="after_each returned int"):
        await art.gather_trajectory_groups([group(1, 2)], after_each=lambda g: 3, pbar_desc=None)


# -- on the real server: leases, steps without a checkpoint, run lineages, SFT turn by turn ------------------------
def _server(art_path, *register):
    """A fresh in-process server on `art_path` (another start of the same server when the path is reused)."""
    return app_client(art_path, Settings(max_new_tokens_limit=8), *register)


async def _groups(client, name, count=2):
    async def turn(rank):
        response = await client.post(
            "/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "seed": rank},
        )
        choice = response.json()["choices"][0]
        return {
            "items": [
                {"role": "user", "content": "x"},
                {"kind": "choice", "token_ids": choice["token_ids"], "prompt_token_ids": choice["prompt_token_ids"]},
            ],
            "reward": float(rank),
        }

    return [{"trajectories": [await turn(r) for r in range(2)]} for _ in range(count)]


TINY = {"name": "tiny", "project": "compat", "base_model": "art-sky/tiny"}


async def test_a_lease_keeps_its_step_served_and_undeleted_until_released(tmp_path):
    async with _server(tmp_path, TINY) as client:
        for _ in range(2):
            status, lines = await train_lines(client, "tiny", {"groups": await _groups(client, "tiny")})
            assert status == 200, lines
        lease = (await client.post("/art/models/tiny/leases", json={"step": 1})).json()
        deleted = await client.post("/art/models/tiny/checkpoints/delete", json={"keep_steps": []})
        assert [c["step"] for c in deleted.json()] == [1, 2]  # the leased step and the current one
        served = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny@1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
        assert served.json()["model"] == "tiny@1"
        assert (await client.delete(f"/art/models/tiny/leases/{lease['id']}")).json() == {"released": True}
        assert (await client.delete(f"/art/models/tiny/leases/{lease['id']}")).json() == {"released": False}
        deleted = await client.post("/art/models/tiny/checkpoints/delete", json={"keep_steps": []})
        assert [c["step"] for c in deleted.json()] == [2]
        missing = await client.post("/art/models/tiny/leases", json={"step": 1})
        assert missing.status_code == 404 and "step 1 of tiny has no checkpoint" in missing.json()["detail"]


async def test_a_step_without_a_checkpoint_is_served_and_a_restart_resumes_from_the_last_saved_one(tmp_path, caplog):
    checkpoints = CheckpointDir(tmp_path, "compat", "tiny")
    async with _server(tmp_path, TINY) as client:
        status, lines = await train_lines(client, "tiny", {"groups": await _groups(client, "tiny")})
        assert lines[-1]["checkpoint_path"] == str(checkpoints.step_dir(1))
        status, lines = await train_lines(
            client, "tiny", {"groups": await _groups(client, "tiny"), "save_checkpoint": False}
        )
        assert status == 200 and lines[-1]["step"] == 2 and "checkpoint_path" not in lines[-1]
        served = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
        assert served.json()["model"] == "tiny@2"
        await client.get("/art/models/tiny/checkpoints")  # returns once the step's background write is done
        assert not (checkpoints.step_dir(2) / OPTIMIZER_STATE).exists()
        assert (checkpoints.step_dir(1) / OPTIMIZER_STATE).exists()
        assert [e["step"] for e in checkpoints.history()] == [1, 2]
    with caplog.at_level(logging.WARNING, "art_sky.cluster"):
        async with _server(tmp_path, TINY) as client:
            assert (await client.get("/art/models/tiny")).json()["step"] == 1
            assert "steps [2] were trained with save_checkpoint=False" in caplog.text
            assert checkpoints.steps() == [0, 1]
            assert {e["step"] for e in checkpoints.history()} == {1}
            moved = (checkpoints.model_dir / "history.unsaved.jsonl").read_text().splitlines()
            assert [json.loads(line)["step"] for line in moved] == [2]
            status, lines = await train_lines(client, "tiny", {"groups": await _groups(client, "tiny")})
            assert lines[-1]["step"] == 2  # trained again under its number


async def test_runs_of_one_name_are_each_a_lineage_of_their_own_served_apart(tmp_path):
    """ART's sweep: one name, several run_names, on one server: each run from step 0 in its own folder, served as
    `name:run` (the bare name answers only where it is one run), trained, listed and pruned on its own."""
    run_a, run_b = TINY | {"run_name": "run-a"}, TINY | {"run_name": "run-b"}
    async with _server(tmp_path, run_a) as client:
        status, lines = await train_lines(client, "tiny", {"groups": await _groups(client, "tiny")})  # its only run
        assert status == 200 and lines[-1]["step"] == 1, lines
        again, second = await asyncio.gather(  # at once: a retry of run-a and a new run under the same name
            client.post("/art/models", json=run_a), client.post("/art/models", json=run_b)
        )
        assert (again.json()["step"], again.json()["served"]) == (1, "tiny:run-a")  # the same run, not reset
        assert (second.json()["step"], second.json()["served"]) == (0, "tiny:run-b"), second.text
        assert (await client.get("/health")).json()["models"] == ["tiny:run-a", "tiny:run-b"]
        for bare in ((await client.get("/art/models/tiny")), await _complete(client, "tiny")):
            assert bare.status_code == 409 and "'tiny' has 2 runs on this server (tiny:run-a, tiny:run-b)" in bare.text
        status, lines = await train_lines(client, "tiny:run-b", {"groups": await _groups(client, "tiny:run-b")})
        assert status == 200 and lines[-1]["step"] == 1, lines
        await train_lines(client, "tiny:run-a", {"groups": await _groups(client, "tiny:run-a")})
        served = {m: (await _complete(client, m)).json()["model"] for m in ("tiny:run-a", "tiny:run-b", "tiny:run-b@0")}
        assert served == {"tiny:run-a": "tiny:run-a@2", "tiny:run-b": "tiny:run-b@1", "tiny:run-b@0": "tiny:run-b@0"}
        kept = await client.post("/art/models/tiny:run-a/checkpoints/delete", json={"keep_steps": []})
        assert [c["step"] for c in kept.json()] == [2]  # run-a's pruned ...
        assert [c["step"] for c in (await client.get("/art/models/tiny:run-b/checkpoints")).json()] == [0, 1]
        assert [e["step"] for e in (await client.get("/art/models/tiny:run-b/history")).json()] == [1]
    async with _server(tmp_path, run_b, TINY) as client:  # a restart: each run resumes; the name's own run is new
        assert (await client.get("/art/models/tiny:run-b")).json()["step"] == 1
        assert (await client.get("/art/models/tiny")).json()["run_name"] is None  # the name is its own run here
        assert (await _complete(client, "tiny")).json()["model"] == "tiny@0"
    assert CheckpointDir(tmp_path, "compat", "run-a").steps() == [2]
    assert CheckpointDir(tmp_path, "compat", "run-b").steps() == [0, 1]
    assert CheckpointDir(tmp_path, "compat", "tiny").steps() == [0]


async def _complete(client, model):
    return await client.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    )


async def test_gradient_accumulation_makes_one_optimizer_step_per_that_many_sequences(tmp_path):
    async with _server(tmp_path, TINY) as client:
        status, lines = await train_lines(
            client, "tiny", {"groups": await _groups(client, "tiny", 3), "config": {"grad_accumulation_sequences": 4}}
        )
        assert status == 200, lines
        metrics = lines[-1]["metrics"]
        assert (metrics["sequences"], metrics["num_gradient_steps"]) == (6.0, 2.0)


async def test_sft_trains_each_turn_of_a_template_that_rewrites_history(tmp_path):
    """Qwen3's template drops an earlier turn's reasoning once a later user turn comes: each assistant turn trains
    in the context the template renders before it, as its own sequence; `assistant_turns="last"` trains only the
    final one."""
    model = TINY | {"name": "think", "base_model": str(template_model(tmp_path / "models", "think"))}
    conversation = [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": "3 + 3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "three and three"},
    ]
    body = {"trajectories": [{"items": conversation, "reward": 0.0}], "learning_rates": [1e-3]}
    async with _server(tmp_path / "art", model) as client:
        every = (await client.post("/art/models/think/sft", json=body)).text.splitlines()
        result = json.loads(every[-1])
        assert result["type"] == "result", result
        assert result["batches"][0]["sequences"] == 2.0  # the rewritten history: one sequence per turn
        last = json.loads(
            (await client.post("/art/models/think/sft", json=body | {"assistant_turns": "last"})).text.splitlines()[-1]
        )
        assert last["batches"][0]["sequences"] == 1.0
        assert last["batches"][0]["trained_tokens"] < result["batches"][0]["trained_tokens"]
        assert math.isfinite(last["batches"][0]["loss"])


def test_the_stand_in_for_arts_local_backend_answers_isinstance_and_says_what_to_install(monkeypatch):
    """Where torch is missing, ART's PipelineTrainer can import ART's LocalBackend (to find art-sky's is not one)."""
    monkeypatch.setattr(releases.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "art.local.backend", raising=False)
    releases._stand_in_for_arts_local_backend()
    stand_in = sys.modules.pop("art.local.backend").LocalBackend
    assert not isinstance(art.Backend(base_url="http://x", api_key="k"), stand_in)
    with pytest.raises(ConfigError, match=r"openpipe-art\[backend\]"):
        stand_in()

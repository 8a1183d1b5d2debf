"""Agents written against the OpenAI API (`env.agent`, forge/env/agent.py): the endpoint's wire format and refusals,
the recorded sequence against what the model sampled, tool calls, history rewrites, failing agents, the `openai`
client, SmolLM2's template, and a training run."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from forge.config import ConfigError, EnvConfig
from forge.env.agent import AgentHost
from forge.env.config import AgentConfig
from forge.env.openai_server import OpenAIServer, chat_response
from forge.metrics import episode_metrics
from forge.records import SamplingParams
from tests.env.agents import post, sum_agent

ROWS = [
    {"prompt": "3+4=", "model_input": "3+4=", "answer": "7"},
    {"prompt": "1+1=", "model_input": "1+1=", "answer": "2"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


def http(url: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Echo:
    """A ChatBackend answering every request of episode 'episode-1' with its last message's text."""

    def models(self, episode):
        from forge.env.openai_server import RequestError

        if episode != "episode-1":
            raise RequestError(404, "no such episode", None, "episode_not_found")
        return ["tiny-random", "policy"]

    def chat(self, episode, request):
        return chat_response(request.model, [({"role": "assistant", "content": request.messages[-1]["content"]},
                                               "stop")] * request.n, 3, 1)  # fmt: skip


def test_the_server_answers_openai_requests_and_refuses_what_it_does_not_support():
    server = OpenAIServer(Echo())
    try:
        base = server.base_url("episode-1")
        assert base.startswith("http://127.0.0.1:") and server.httpd.server_address[0] == "127.0.0.1"
        status, body = http(f"{base}/models")
        assert status == 200 and [m["id"] for m in body["data"]] == ["tiny-random", "policy"]
        ok = {"model": "policy", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "n": 2}
        status, body = http(f"{base}/chat/completions", json.dumps(ok).encode())
        assert status == 200 and body["object"] == "chat.completion" and len(body["choices"]) == 2
        assert body["choices"][1] == {"index": 1, "message": {"role": "assistant", "content": "hi"},
                                      "finish_reason": "stop", "logprobs": None}  # fmt: skip
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        refused = {
            "stream": ({**ok, "stream": True}, 400, "streaming is not supported yet"),
            "model": ({**ok, "model": "gpt-4o"}, 404, "model 'gpt-4o' is not served here"),
            "n": ({**ok, "n": 0}, 400, "n must be an integer in [1, 16]"),
            "temperature": ({**ok, "temperature": "hot"}, 400, "temperature must be a number"),
            "messages": ({**ok, "messages": []}, 400, "messages must be a non-empty list"),
            "functions": ({**ok, "functions": []}, 400, "unsupported parameter(s) ['functions']"),
            "messages[0]": (
                {**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                400,
                "no images",
            ),
            "tool_choice": ({**ok, "tool_choice": "required"}, 400, "tool_choice='required' is not supported"),
        }
        for param, (request, code, says) in refused.items():
            status, body = http(f"{base}/chat/completions", json.dumps(request).encode())
            assert status == code and says in body["error"]["message"] and body["error"]["param"] == param, body
        assert http(f"{base}/chat/completions", b"{not json")[0] == 400
        assert http(f"{base}/chat/completions")[0] == 405  # GET
        assert http(server.base_url("episode-2") + "/models")[0] == 404  # not an episode's URL
        assert http(f"http://127.0.0.1:{server.port}/v1/models")[0] == 404  # nothing outside an episode
    finally:
        server.close()


def tiny_backend(tok):
    from forge.models import build_tiny_model
    from forge.rollout.hf import HFBackend

    torch.manual_seed(0)
    return HFBackend(build_tiny_model(tok), tok)


def recording(sample):
    """`sample` that also records every (context, sampled ids, log-probs) it returned."""
    seen = []

    def wrapped(contexts, params, seeds=None):
        wrapped.calls += 1
        outs = sample(contexts, params, seeds)
        seen.extend((tuple(c), tuple(ids), tuple(lp)) for c, (ids, lp) in zip(contexts, outs, strict=True))
        return outs

    wrapped.calls = 0
    return wrapped, seen


def test_an_agent_plays_two_requests_and_its_sequence_is_what_the_model_sampled(tok):
    """sum_agent (urllib, ~10 lines) asks twice per episode; each episode is one sequence: prompt, reply 1 (loss 1),
    '?' (the agent's message, loss 0), reply 2 (loss 1); every sampled segment is one the backend returned for
    exactly the tokens before it, with its log-probs, which the model's own forward pass gives back."""
    backend = tiny_backend(tok)
    cfg = EnvConfig(max_turns=4, max_tokens=40, agent=AgentConfig(batch_wait_ms=5000))  # batches wait for every episode
    host = AgentHost(sum_agent, tok, cfg, "tiny-random", use_template=False)
    sample, seen = recording(backend.generate_ids)
    try:
        ro = host.rollouts(sample, ROWS, SamplingParams(max_new_tokens=3, n=2, seed=0), version=3)
    finally:
        host.close()
    assert ro.episodes.requests == [2] * 4 and ro.episodes.prefix_breaks == [0] * 4 and ro.episodes.turns == [2] * 4
    assert not any(ro.episodes.failures) and ro.episodes.policy_versions == [[3, 3]] * 4
    assert len(seen) == 8 and sample.calls == 2  # 4 episodes x 2 requests, sampled in one batch per round
    question = tok("?", add_special_tokens=False)["input_ids"]
    recorded = []
    for i in range(4):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()
        ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
        loss = ro.loss_mask[i][: len(ids)].tolist()
        lps = ro.sampling_logprobs[i][: len(ids)].tolist()
        assert prompt == tok(ROWS[i // 2]["model_input"], add_special_tokens=False)["input_ids"]
        cut = loss.index(0)  # reply 1, then '?', then reply 2 (each 3 tokens or up to eos)
        assert ids[cut : cut + len(question)] == question and loss == [1] * cut + [0] + [1] * (len(ids) - cut - 1)
        recorded += [(tuple(prompt), tuple(ids[:cut]), tuple(lps[:cut])),
                     (tuple(prompt + ids[: cut + 1]), tuple(ids[cut + 1 :]), tuple(lps[cut + 1 :]))]  # fmt: skip
        assert lps[cut] == 0.0
        full = torch.tensor([prompt + ids])  # the sampler's log-probs are the model's own at temperature 1
        with torch.no_grad():
            logp = torch.log_softmax(backend.model(full).logits[0, :-1].float(), -1)  # temperature 1
        own = logp[len(prompt) - 1 :].gather(-1, full[0, len(prompt) :, None]).squeeze(-1)
        sampled = torch.tensor(loss, dtype=torch.bool)
        assert torch.allclose(own[sampled], torch.tensor(lps)[sampled], atol=1e-4)
    assert sorted(recorded) == sorted(seen)  # every segment trained is one the backend sampled, for its context
    # the verifiers' text is the final reply; the agent's reward is each episode's environment's
    assert ro.texts[0] == ro.episodes.transcripts[0][-1]["content"]
    assert [type(e).__name__ for e in ro.episodes.environments] == ["AgentResult"] * 4
    assert episode_metrics(ro)["env/agent_requests"] == 2.0 and episode_metrics(ro)["env/agent_prefix_breaks"] == 0.0


def scripted(tok, turns: list[str], marker: str, first: int = 0):
    """A sampler that emits turns[k] + eos where the context holds `first` + k copies of `marker`, log-prob -0.5."""

    def sample(contexts, params, seeds=None):
        out = []
        for ctx in contexts:
            k = max(tok.decode(ctx).count(marker) - first, 0)
            ids = tok(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return sample


def tool_agent(base_url: str, row: dict) -> float:
    """A tool loop with urllib: the model's tool calls answered until it replies in text."""
    messages = [{"role": "user", "content": row["model_input"]}]
    for _ in range(3):
        reply = post(base_url, {"model": "policy", "messages": messages, "tools": TOOLS})["choices"][0]
        messages.append(reply["message"])
        if reply["finish_reason"] != "tool_calls":
            return float(reply["message"]["content"] == row["answer"])
        for call in reply["message"]["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
    return 0.0


def test_tool_calls_come_back_in_openais_format_and_the_tool_answer_is_masked(tok):
    host = AgentHost(tool_agent, tok, EnvConfig(max_turns=4, max_tokens=200), "tiny-random", use_template=False)
    sample, seen = recording(scripted(tok, [CALL, "7"], "</tool_response>"))
    try:
        ro = host.rollouts(sample, ROWS[:1], SamplingParams(max_new_tokens=64, n=1, seed=0), version=0)
    finally:
        host.close()
    assert ro.episodes.environments[0].reward == 1.0 and ro.episodes.tool_calls == [1] and ro.texts == ["7"]
    ids = ro.completion_ids[0][ro.completion_mask[0].bool()].tolist()
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer = tok("<tool_response>7</tool_response>", add_special_tokens=False)["input_ids"]
    assert ids == call + answer + tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ro.loss_mask[0][: len(ids)].tolist() == [1] * len(call) + [0] * len(answer) + [1] * 2
    assert seen[0][0] == tuple(tok("<tools>add(a: integer, b: integer)</tools>3+4=")["input_ids"])


def stop_agent(base_url: str, row: dict) -> float:
    body = {"model": "policy", "messages": [{"role": "user", "content": "q"}], "stop": ["+"], "max_tokens": 1000}
    reply = post(base_url, body)["choices"][0]
    return float(reply["message"]["content"] == "7" and reply["finish_reason"] == "stop")


def test_a_stop_string_cuts_the_reply_text_and_its_tokens_after_it(tok):
    host = AgentHost(stop_agent, tok, EnvConfig(), "tiny-random", use_template=False)
    try:
        ro = host.rollouts(scripted(tok, ["7+1=8"], "?"), ROWS[:1], SamplingParams(max_new_tokens=8), version=0)
    finally:
        host.close()
    assert ro.episodes.environments[0].reward == 1.0 and ro.texts == ["7"]
    kept = ro.completion_ids[0][ro.completion_mask[0].bool()].tolist()
    assert kept == tok("7+", add_special_tokens=False)["input_ids"]  # sampled up to the stop string, trained as such


def sampled_segments(ro) -> list[tuple[tuple, tuple, tuple]]:
    """(context, sampled ids, their log-probs) of every run of loss-mask 1 in every row of `ro`."""
    out = []
    for i in range(ro.num_completions):
        prompt = ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()
        n = int(ro.completion_mask[i].sum())
        ids, loss, lps = ro.completion_ids[i][:n].tolist(), ro.loss_mask[i][:n].tolist(), ro.sampling_logprobs[i][:n]
        k = 0
        while k < n:
            if not loss[k]:
                k += 1
                continue
            end = loss.index(0, k) if 0 in loss[k:] else n
            out.append((tuple(prompt + ids[:k]), tuple(ids[k:end]), tuple(lps[k:end].tolist())))
            k = end
    return out


def test_a_history_rewrite_makes_a_second_sequence_with_the_episodes_reward_and_advantage(tok):
    """summarising_agent asks, starts over from a summary (a prefix break), then appends to the new conversation:
    two sequences per episode (1 request, then 2), every sampled segment one the engine sampled for exactly its
    context; the reward stage scores the episode once and both sequences train with its advantage."""
    from forge.rewards.config import RewardConfig
    from forge.sequences import training_rows
    from forge.workers import RewardWorker
    from tests.env.agents import summarising_agent

    backend = tiny_backend(tok)
    host = AgentHost(summarising_agent, tok, EnvConfig(max_tokens=60), "tiny-random", use_template=False)
    sample, seen = recording(backend.generate_ids)
    try:
        ro = host.rollouts(sample, ROWS, SamplingParams(max_new_tokens=3, n=2, seed=0), version=0)
    finally:
        host.close()
    e = ro.episodes
    assert e.requests == [3] * 4 and e.prefix_breaks == [1] * 4 and e.turns == [3] * 4 and not any(e.failures)
    assert [[s.turns for s in more] for more in e.more_sequences] == [[2]] * 4
    for i, more in enumerate(e.more_sequences):
        assert tok.decode(more[0].prompt_ids).startswith("Earlier you said ")
        assert more[0].prompt_ids[-4:] == tok(ROWS[i // 2]["model_input"], add_special_tokens=False)["input_ids"]
    scored = RewardWorker(RewardConfig(), advantage="zscore", seed=0, steps=1, prompts_per_step=2).score(ROWS, ro, 1)
    own = [x.reward for x in e.environments]
    assert scored.rewards.tolist() == pytest.approx(own) and len(set(own)) > 1  # the agent's, one per episode
    rows = training_rows(ro, scored.advantages)
    assert rows.episodes == 4 and rows.rollouts.num_completions == 8
    assert torch.equal(rows.advantages, torch.cat([scored.advantages, scored.advantages]))  # row i+4: episode i's
    assert sorted(sampled_segments(rows.rollouts)) == sorted(seen) and len(seen) == 12  # 4 episodes x 3 requests
    assert episode_metrics(ro)["env/agent_prefix_breaks"] == 1.0
    assert "training sequence 2 begins here" in json.dumps(e.transcripts[0])
    # samples.jsonl's token record (the dashboard's token view) keeps the second sequence, after its own prompt
    from forge.rundir import token_record

    (second,) = token_record(ro, scored.advantages, 0, lambda ids: [tok.decode([t]) for t in ids])["more"]
    seq = e.more_sequences[0][0]
    assert second["ids"] == seq.ids and second["loss"] == seq.loss and sum(second["loss"]) > 0
    assert second["prompt_tokens"] == len(seq.prompt_ids) and len(second["text"]) == len(seq.ids)
    assert second["logprob"] == [round(x, 4) for x in seq.logprobs]


def test_an_agent_that_appends_stays_one_sequence(tok):
    from forge.sequences import training_rows

    host = AgentHost(sum_agent, tok, EnvConfig(max_tokens=40), "tiny-random", use_template=False)
    try:
        ro = host.rollouts(scripted(tok, ["5"], "?"), ROWS, SamplingParams(max_new_tokens=4, n=1, seed=0), version=0)
    finally:
        host.close()
    assert ro.episodes.more_sequences == [[], []] and ro.episodes.prefix_breaks == [0, 0]
    assert training_rows(ro, torch.zeros(2)).rollouts is ro


def test_the_sequences_of_a_failed_episode_are_all_out_of_the_loss(tok):
    """env.max_turns=2: summarising_agent's third request is refused, it raises, its episode fails after two
    sequences; neither trains."""
    from forge.sequences import training_rows
    from tests.env.agents import summarising_agent

    host = AgentHost(summarising_agent, tok, EnvConfig(max_turns=2, max_tokens=60), "tiny-random", use_template=False)
    try:
        ro = host.rollouts(scripted(tok, ["5"], "?"), ROWS, SamplingParams(max_new_tokens=4, n=1, seed=0), version=0)
    finally:
        host.close()
    assert ro.episodes.prefix_breaks == [1, 1] and all("env.max_turns=2" in f for f in ro.episodes.failures)
    assert [len(more[0].loss) for more in ro.episodes.more_sequences] == [2, 2]  # '5' eos: kept, not trained
    assert training_rows(ro, torch.ones(2)).rollouts.loss_mask.sum() == 0


def moody_agent(base_url: str, row: dict):
    """Fails the way row['kind'] says; 'ok' plays one request and returns 1."""
    kind = row["kind"]
    if kind == "hang":
        time.sleep(3)
    if kind == "silent":
        return 1.0
    post(base_url, {"model": "policy", "messages": [{"role": "user", "content": "1+1="}], "stream": kind == "stream"})
    if kind == "raise":
        raise ValueError("boom\nsecond line")
    return "1" if kind == "text" else 1.0


def test_agents_that_raise_hang_or_misbehave_fail_their_own_episode_in_one_line(tok):
    kinds = ["ok", "raise", "hang", "text", "silent", "stream"]
    rows = [{"prompt": "q", "model_input": "q", "kind": k} for k in kinds]
    host = AgentHost(moody_agent, tok, EnvConfig(agent=AgentConfig(timeout_s=1.0)), "tiny-random", use_template=False)
    t0 = time.perf_counter()
    try:
        ro = host.rollouts(scripted(tok, ["2"], "?"), rows, SamplingParams(max_new_tokens=4, n=1), version=0)
    finally:
        host.close()
    assert time.perf_counter() - t0 < 2.5  # the hung agent is left behind after env.agent.timeout_s
    failures = dict(zip(kinds, ro.episodes.failures, strict=True))
    assert failures["ok"] == "" and ro.episodes.environments[0].reward == 1.0
    assert failures["raise"] == "agent moody_agent raised ValueError: boom second line"
    assert failures["hang"] == "agent moody_agent did not return within env.agent.timeout_s=1 s"
    assert failures["text"] == "agent moody_agent returned a str: return a float or None"
    assert failures["silent"] == "agent moody_agent made no request to its base URL"
    assert "streaming is not supported yet" in failures["stream"]
    assert ro.finish_reasons == ["stop"] + ["error"] * 5 and ro.loss_mask[1:].sum() == 0


def test_the_openai_client_plays_a_tool_loop():
    """The official client, unchanged: tools, tool_calls, a tool message back; the episode stays one sequence."""
    openai = pytest.importorskip("openai")
    from forge.models import build_char_tokenizer

    tok = build_char_tokenizer()

    def agent(base_url: str, row: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": row["model_input"]}]
        assert [m.id for m in client.models.list()] == ["tiny-random", "policy"]
        for _ in range(3):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
            messages.append(reply.message.model_dump(exclude_none=True))
            if not reply.message.tool_calls:
                return float(reply.message.content == row["answer"])
            for call in reply.message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
        return 0.0

    host = AgentHost(agent, tok, EnvConfig(max_tokens=200), "tiny-random", use_template=False)
    try:
        ro = host.rollouts(
            scripted(tok, [CALL, "7"], "</tool_response>"), ROWS[:1], SamplingParams(max_new_tokens=64), 0
        )
    finally:
        host.close()
    assert ro.episodes.failures == [""] and ro.episodes.environments[0].reward == 1.0
    assert ro.episodes.prefix_breaks == [0] and ro.episodes.turns == [2] and ro.episodes.tool_calls == [1]


def test_smollm2s_template_bridges_replies_and_tool_calls_without_re_tokenising():
    """With a real chat template the next request's prompt is the last prompt + the sampled ids + the template's
    diff (SmolLM2: '\\n', then the tool's and the next assistant's headers)."""
    from forge.config import ModelConfig
    from forge.models import load_tokenizer

    smol = load_tokenizer(ModelConfig(path="smollm2-135m-instruct"))
    host = AgentHost(tool_agent, smol, EnvConfig(max_tokens=400), "smollm2", use_template=True)
    sample, seen = recording(scripted(smol, [CALL, "7"], "<|im_start|>assistant", first=1))
    try:
        ro = host.rollouts(sample, ROWS[:1], SamplingParams(max_new_tokens=64, n=1, seed=0), version=0)
    finally:
        host.close()
    assert ro.episodes.prefix_breaks == [0] and ro.episodes.turns == [2] and ro.episodes.environments[0].reward == 1.0
    (first, call, _), (second, _, _) = seen
    assert second[: len(first) + len(call)] == first + call
    assert smol.decode(second[len(first) + len(call) :]) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert smol.decode(first).startswith("<|im_start|>system\nYou can call these tools:")  # tools= not rendered


def test_an_agent_that_is_a_program_plays_through_its_environment_and_fails_in_one_line(tok, monkeypatch):
    """env.agent.command: the program gets OPENAI_BASE_URL and its row on stdin, and its last stdout line is the
    reward (the same as sum_agent's in process); `none` leaves it to the verifiers; exiting non-zero, hanging
    past env.agent.timeout_s (its process killed) or printing a word fails the episode in one line; the run's secrets
    are not in its environment."""
    import sys

    from forge.env.agent_command import command_agent

    monkeypatch.setenv("FORGEWEAVE_TEST_PASSWORD", "x")
    monkeypatch.setenv("FORGEWEAVE_TEST_PLAIN", "y")
    kinds = ["ok", "none", "exit", "hang", "word", "secrets"]
    rows = [{**ROWS[0], "kind": k} for k in kinds]
    agent = command_agent(f"{sys.executable} tests/env/agent_program.py", timeout_s=3.0)
    cfg = EnvConfig(max_tokens=40, agent=AgentConfig(timeout_s=3.0))
    host = AgentHost(agent, tok, cfg, "tiny-random", use_template=False)
    t0 = time.perf_counter()
    try:
        ro = host.rollouts(scripted(tok, ["7", "7"], "?"), rows, SamplingParams(max_new_tokens=3, n=1), version=0)
    finally:
        host.close()
    assert time.perf_counter() - t0 < 15  # the hung program is killed at env.agent.timeout_s
    e, name = ro.episodes, f"agent command {sys.executable!r}"
    failures = dict(zip(kinds, e.failures, strict=True))
    assert failures["ok"] == failures["none"] == failures["secrets"] == "" and e.requests[0] == 2
    assert e.environments[0].reward == 1.0 and e.environments[1].reward is None  # '7' twice: sum_agent's 1.0
    assert failures["exit"] == f"{name} raised AgentCommandError: exited with code 3: cannot go on"
    assert failures["hang"].startswith(f"{name} ") and "env.agent.timeout_s=3" in failures["hang"]
    assert failures["word"] == (f"{name} raised AgentCommandError: printed 'great' as its last line: print the reward "
                                "(a number) or nothing")  # fmt: skip
    assert e.environments[5].reward == 1.0  # it saw the run's plain variable, not its password
    assert ro.finish_reasons[2:5] == ["error"] * 3
    deadline = time.time() + 10
    while _programs() and time.time() < deadline:
        time.sleep(0.1)
    assert not _programs()  # the hung one was killed at its timeout (its process group with it)


def _programs() -> list[str]:
    """PIDs of the agent programs still running."""
    from pathlib import Path

    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"tests/env/agent_program.py" in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def test_env_agent_is_checked_at_start():
    agent = AgentConfig(fn="tests.env.agents:sum_agent")
    with pytest.raises(ConfigError, match="env.agent.fn' and env.environment_factory both give the environment"):
        EnvConfig(agent=agent, environment_factory="m:C").check("env.")
    with pytest.raises(ConfigError, match="'env.agent.fn' must look like 'pkg.module:function'"):
        AgentConfig(fn="sum_agent").check("env.agent.")
    assert EnvConfig(agent=agent).enabled and EnvConfig(agent=agent).source_key == "env.agent.fn"
    program = AgentConfig(command="python agent.py")
    assert EnvConfig(agent=program).enabled and EnvConfig(agent=program).source_key == "env.agent.command"
    with pytest.raises(ConfigError, match="env.agent.command' and env.agent.fn both give the agent"):
        AgentConfig(fn="tests.env.agents:sum_agent", command="python agent.py").check("env.agent.")
    with pytest.raises(ConfigError, match="env.agent.command' cannot be split"):
        AgentConfig(command="python 'agent.py").check("env.agent.")
    with pytest.raises(ConfigError, match="env.agent.command' and env.tools both give the environment"):
        EnvConfig(agent=program, tools=["m:f"]).check("env.")


def test_an_agent_trains_a_lora_adapter(tmp_path):
    """Issue 44 with LoRA: the endpoint samples from the policy with its adapter (in process: the trainer's own peft
    module), the update trains only the adapter, and the next step's requests are sampled from the updated one."""
    import forge
    from forge.tracking import read_metrics

    sets = ["steps=2", "threads=1", "tracking.mlflow=false", "checkpoint.every=0", "eval.every=0", "eval.max_problems=1",
            "env.agent.fn=tests.env.agents:sum_agent", "env.max_tokens=12", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=3", "update.lr=2e-3", "model.lora.rank=4"]  # fmt: skip
    forge.train(preset="tiny", overrides=sets, run_dir=tmp_path / "run", progress=False)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0 and "reward/mean" in r]
    assert len(rows) == 2 and all(r["env/agent_requests"] == 2.0 and r["env/failed"] == 0 for r in rows)
    assert all(r["train/grad_norm"] > 0 for r in rows) and rows[1]["policy/version"] == 2
    # the sampler is the policy being trained (adapter on): its log-probs are the trainer's to float rounding
    assert all(abs(r["train/logprob_diff"]) < 1e-4 for r in rows)


@pytest.mark.slow
def test_a_training_run_with_an_agent_logs_its_reward_and_the_reward_rises(tmp_path):
    import forge
    from forge.tracking import read_metrics

    sets = ["steps=30", "threads=1", "tracking.mlflow=false", "checkpoint.every=0", "eval.every=0",
            "env.agent.fn=tests.env.agents:sum_agent", "env.max_tokens=12", "rollout.prompts_per_step=8",
            "rollout.group_size=8", "rollout.max_new_tokens=3", "update.lr=2e-3", "data.train_size=200"]  # fmt: skip
    forge.train(preset="tiny", overrides=sets, run_dir=tmp_path / "run", progress=False)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0 and "reward/mean" in r]
    assert len(rows) == 30 and all(r["env/agent_requests"] == 2.0 and r["env/failed"] == 0 for r in rows)
    first, last = rows[:5], rows[-5:]
    rise = sum(r["reward/mean"] for r in last) / 5 - sum(r["reward/mean"] for r in first) / 5
    # measured (threads=1, 2-core Xeon, ~30 s a run), reward/mean over steps 1-5 -> steps 26-30: seed 0 0.117 ->
    # 0.256 (rise 0.139), seed 1 0.102 -> 0.263 (0.161), seed 2 0.121 -> 0.264 (0.143). The test runs seed 0 and asks
    # a rise above 0.08, below the worst seed's; chance (no learning) is 0. What is learnt is mostly the format (0.25
    # for a final reply with a digit), as in tests/env/test_multiturn_learning.py.
    assert rise > 0.08, rise

"""`agentjax router` in front of three real `agentjax serve --model preset:tiny-dense` replicas
(batch-invariant numerics) sharing a real Mooncake master: the official openai and anthropic SDKs
work through it unchanged (streaming included), a session's turns stay on one replica and read its
cache, the prefix policy finds the replica that holds a prompt's prefix from its KV events, pools
move a first turn's session to its decode replica with its KV prefetched in the tool gap (its next
turn cached there and as fast as a turn that stayed), P/D gives one replica's greedy tokens with
the prompt's pages pulled over Mooncake, a killed master degrades P/D to one replica, a replica
killed mid-turn costs no session and no duplicate reply, and the router answers 503 once no replica
is left. The tests share the processes and run in file order: the last three kill things."""
from __future__ import annotations

import concurrent.futures
import signal
import statistics
import sys
import time

import httpx
import pytest

from tests.e2e.conftest import CLIENT_TIMEOUT_S, start_server, stop_server

pytestmark = pytest.mark.slow

REPLICA_FLAGS = ("--model", "preset:tiny-dense", "--num-kv-blocks", "1024", "--max-num-seqs", "8",
                 "--numerics", "batch_invariant", "--mooncake-segment-gb", "0.0625")
ROUTER_COMMAND = [sys.executable, "-m", "agentjax.cli", "--log-level", "INFO", "router"]
PREFILL_HEADER = "x-agentjax-prefill-replica"
ROUNDS = 5  # sessions of each kind in the migration test
PREFETCHED = 'agentjax:router_kv_migrations_total{outcome="prefetched",reason="pool_switch"}'
SYSTEM = "You are a careful coding agent working in a large repository. " * 6  # several 16-token blocks
REPLICA_HEADER = "x-agentjax-replica"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Mooncake master, three replicas and four routers over them: sticky and prefix over all
    three, pools with the first replica for first turns, P/D with the first replica for prefills and
    the second for decodes (the third stays out of it: it serves the P/D test's reference); stopped
    after the module."""
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (and libibverbs1) is not installed")
    from agentjax.kv.offload.mooncake import MooncakeMaster

    log_dir = tmp_path_factory.mktemp("router")
    master = MooncakeMaster(log_path=log_dir / "mooncake-master.log")
    flags = (*REPLICA_FLAGS, "--mooncake-master", master.address)
    replicas, routers = [], []
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replicas = list(pool.map(lambda _: start_server(log_dir, *flags), range(3)))
        urls = [replica.base_url for replica in replicas]
        for policy in ("sticky", "prefix"):
            routers.append(start_server(log_dir, "--policy", policy, "--health-interval", "0.2",
                                        "--replica", *urls, command=ROUTER_COMMAND))
        routers.append(start_server(log_dir, "--policy", "pools", "--prefill-replica", urls[0],
                                    "--decode-replica", *urls[1:], command=ROUTER_COMMAND))
        routers.append(start_server(log_dir, "--health-interval", "0.2", "--prefill-replica", urls[0],
                                    "--decode-replica", urls[1], command=ROUTER_COMMAND))  # pd: the default here
        yield {"replicas": replicas, "master": master, "sticky": routers[0], "prefix": routers[1],
               "pools": routers[2], "pd": routers[3]}
    finally:
        for process in routers:
            assert stop_server(process) == 0, process.log_tail()
        alive = [replica for replica in replicas if replica.process.poll() is None]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # with the master gone each takes seconds
            statuses = list(pool.map(stop_server, alive))
        master.stop()
        for replica, status in zip(alive, statuses):
            assert status == 0, replica.log_tail()


def replica_of(cluster, url: str):
    return next(r for r in cluster["replicas"] if r.base_url == url)


def kill(replica) -> None:
    replica.process.send_signal(signal.SIGKILL)
    replica.process.wait(30)


def chat_turns(user_texts: list[str]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_texts[0]}]


def test_the_openai_sdk_works_through_the_router_and_a_sessions_turns_read_one_replicas_cache(cluster):
    client = cluster["sticky"].openai()
    model = client.models.list().data[0].id
    messages = chat_turns(["List the files."])
    session = {"X-Session-ID": "openai-session"}
    first = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=6, temperature=0, extra_headers=session,
        extra_body={"ignore_eos": True})
    home = first.headers[REPLICA_HEADER]
    reply = first.parse()
    assert reply.usage.completion_tokens == 6
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Open the first one."}]
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers=session,
            extra_body={"ignore_eos": True}) as streamed:
        assert streamed.headers[REPLICA_HEADER] == home
        chunks = list(streamed.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens >= 64, "the second turn should read the first turn's cache"


def test_the_anthropic_sdk_works_through_the_router_streaming_included(cluster):
    import anthropic

    client = anthropic.Anthropic(base_url=cluster["sticky"].base_url, api_key="unused",
                                 timeout=CLIENT_TIMEOUT_S, max_retries=0)
    model = cluster["sticky"].openai().models.list().data[0].id
    metadata = {"user_id": '{"device_id": "d", "session_id": "claude-session"}'}
    reply = client.messages.create(model=model, max_tokens=5, system=SYSTEM, metadata=metadata,
                                   messages=[{"role": "user", "content": "Say hi."}])
    assert reply.content and reply.usage.output_tokens >= 1
    with client.messages.stream(model=model, max_tokens=5, system=SYSTEM, metadata=metadata,
                                messages=[{"role": "user", "content": "Say hi."}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "".join(block.text for block in final.content if block.type == "text")
    assert final.usage.cache_read_input_tokens >= 64  # the same session, the same replica


def test_the_responses_api_chain_continues_on_the_replica_that_stored_it(cluster):
    client = cluster["sticky"].openai()
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, input="List the files.", instructions=SYSTEM, max_output_tokens=4)
    second = client.responses.with_raw_response.create(model=model, input="Open the first.", instructions=SYSTEM,
                                                      max_output_tokens=4, previous_response_id=first.id)
    assert second.headers["x-agentjax-route-reason"] == "response_owner"
    assert second.parse().usage.input_tokens_details.cached_tokens > 0


def test_the_prefix_policy_sends_a_new_session_to_the_replica_holding_its_prefix(cluster):
    client = cluster["prefix"].openai()
    model = client.models.list().data[0].id
    shared = "Shared project context for every subagent: " + "the build uses bazel and pytest. " * 12
    homes, cached = [], []
    for name in ("agent-a", "agent-b", "agent-c"):
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=2, temperature=0, extra_headers={"X-Session-ID": name},
            messages=[{"role": "system", "content": shared}, {"role": "user", "content": f"I am {name}."}])
        homes.append(raw.headers[REPLICA_HEADER])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        time.sleep(0.8)  # the router polls the replicas' KV events every 0.2 s
    assert homes[1] == homes[0] and homes[2] == homes[0], homes
    assert cached[0] == 0 and min(cached[1:]) >= 64, cached


def long_context(tag: str) -> list[dict]:
    """A first turn of about 1,100 tokens whose every page is the session's own (a tag of two
    characters, so that every session's turns have the same shapes)."""
    return [{"role": "system", "content": f"Session {tag}. " + SYSTEM * 15},
            {"role": "user", "content": "Plan the change."}]


TOOL_RESULT = "".join(f"src/module_{i}.py: 3 functions, tests pass\n" for i in range(24))  # about 300 tokens


def later_turn(messages: list[dict]) -> list[dict]:
    """The next turn's messages: the agent's call (the same text for every session), then the tool's result."""
    return messages + [{"role": "assistant", "content": "I will list the modules."},
                       {"role": "tool", "content": TOOL_RESULT}]


def warm_up_migrations(replicas, model: str) -> None:
    """What the timed turns run, once untimed on every replica (CPU compiles cost seconds): a first
    turn on the prefill replica, its flush, each decode replica's prefetch of it (pages loaded from
    Mooncake) and a later turn there; a later turn on the prefill replica too."""
    prefill, *decoders = replicas
    for index, target in enumerate(decoders):
        warm = f"w{index}"
        messages = long_context(warm)
        prefill.openai().chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                                 extra_headers={"X-Session-ID": warm})
        assert httpx.post(f"{prefill.base_url}/kv/flush", timeout=CLIENT_TIMEOUT_S).status_code == 200
        prefetch = {"path": "/v1/chat/completions", "body": {"model": model, "messages": messages}, "session_id": warm}
        assert httpx.post(f"{target.base_url}/kv/prefill", json=prefetch, timeout=CLIENT_TIMEOUT_S).status_code == 200
        streamed_turn(target.openai(), model, later_turn(messages), warm)
    streamed_turn(prefill.openai(), model, later_turn(messages), warm)


def streamed_turn(client, model: str, messages: list[dict], session: str) -> tuple[float, int, str]:
    """(seconds to the first token, cached prompt tokens, the replica that served it) of one streamed turn."""
    started = time.monotonic()
    first_token, usage = None, None
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=messages, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session},
            extra_body={"ignore_eos": True}) as streamed:
        for chunk in streamed.parse():
            if chunk.choices and chunk.choices[0].delta.content and first_token is None:
                first_token = time.monotonic() - started
            usage = chunk.usage or usage
        served = streamed.headers.get(REPLICA_HEADER)  # None straight from a replica
    return first_token, usage.prompt_tokens_details.cached_tokens, served


def wait_for_metric(server, name: str, at_least: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while router_metric(server, name) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed below {at_least}:\n{server.log_tail()}"
        time.sleep(0.05)


def test_pools_move_a_first_turns_session_to_its_decode_replica_with_its_kv_prefetched_in_the_tool_gap(cluster):
    """Acceptance 4: the moved session's next turn reads its prefix from the cache of the replica it
    moved to (pages pulled over Mooncake in the gap), and its time to first token is within 1.5x of a
    turn whose session stayed on its replica: medians over five sessions of each, after every replica
    has compiled the shapes these turns run, the two later turns of a round sent at the same moment
    (so that both meet the same load on this shared machine), each computing a 300-token tool result."""
    pools, sticky = cluster["pools"], cluster["sticky"]
    model = pools.openai().models.list().data[0].id
    prefill_url = cluster["replicas"][0].base_url
    gap = {"agent_hints": {"expected_next_turn_s": 5.0}}
    warm_up_migrations(cluster["replicas"], model)
    loaded_before = {r.base_url: mooncake_pages(r, "loaded") for r in cluster["replicas"][1:]}
    timings: dict[str, list] = {"stayed": [], "moved": []}
    for round_index in range(ROUNDS):
        for kind, router in (("stayed", sticky), ("moved", pools)):
            first = router.openai().chat.completions.with_raw_response.create(
                model=model, messages=long_context(f"{kind[0]}{round_index}"), max_tokens=2, temperature=0,
                extra_body=gap, extra_headers={"X-Session-ID": f"{kind[0]}{round_index}"})
            assert kind == "stayed" or first.headers[REPLICA_HEADER] == prefill_url
        # the tool runs; the router has moved the pooled session and prefetched its KV by the time it is done
        wait_for_metric(pools, PREFETCHED, round_index + 1)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            later = {kind: pool.submit(streamed_turn, router.openai(), model,
                                       later_turn(long_context(f"{kind[0]}{round_index}")), f"{kind[0]}{round_index}")
                     for kind, router in (("stayed", sticky), ("moved", pools))}
            for kind, future in later.items():
                timings[kind].append(future.result())
    print(f"later-turn TTFT, moved: {sorted(t for t, _, _ in timings['moved'])}, "
          f"stayed: {sorted(t for t, _, _ in timings['stayed'])}")
    first_turn_pages = 1000 // 16 * 16  # the first turn's prompt is over 1,000 tokens: its whole pages at least
    assert min(cached for _, cached, _ in timings["moved"]) >= first_turn_pages, timings["moved"]
    assert prefill_url not in {served for _, _, served in timings["moved"]}
    loaded = sum(mooncake_pages(r, "loaded") - loaded_before[r.base_url] for r in cluster["replicas"][1:])
    assert loaded >= ROUNDS * first_turn_pages // 16, "the moved sessions' pages should come over Mooncake"
    assert router_metric(pools, "agentjax:router_session_migrations_total") == ROUNDS
    assert router_metric(pools, "agentjax:router_kv_migrations_total") == ROUNDS == router_metric(pools, PREFETCHED)
    moved, stayed = (statistics.median(t for t, _, _ in timings[kind]) for kind in ("moved", "stayed"))
    assert moved <= 1.5 * stayed, timings


def pd_messages(task: str) -> list[dict]:
    """A prompt of about 300 tokens whose every page is its own (no earlier test's prompt starts so)."""
    return [{"role": "system", "content": f"P/D: {task} " + SYSTEM * 4}, {"role": "user", "content": task}]


def greedy_tokens(client, model: str, messages: list[dict], **extra) -> tuple[list[int], object]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra.pop("body", {})}, **extra)
    reply = raw.parse()
    return reply.choices[0].model_extra["token_ids"], raw


def test_pd_gives_one_replicas_greedy_tokens_with_the_prompts_pages_pulled_over_mooncake(cluster):
    """Acceptance 3: the prefill replica computes the prompt's KV and stores its pages in Mooncake; the
    decode replica loads them by block hash and replies; tokens equal one replica's (the third
    replica, alone, under its own cache salt so that nothing is shared)."""
    prefill, decode, alone = cluster["replicas"]
    pd = cluster["pd"]
    model = pd.openai().models.list().data[0].id
    messages = pd_messages("Rename the helper and update its callers.")
    reference, _ = greedy_tokens(alone.openai(), model, messages, body={"cache_salt": "one-replica"})
    stored, loaded = mooncake_pages(prefill, "stored"), mooncake_pages(decode, "loaded")
    tokens, raw = greedy_tokens(pd.openai(), model, messages, extra_headers={"X-Session-ID": "pd-session"})
    assert tokens == reference
    assert raw.headers[PREFILL_HEADER] == prefill.base_url and raw.headers[REPLICA_HEADER] == decode.base_url
    prompt_pages = (raw.parse().usage.prompt_tokens - 1) // 16
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == prompt_pages * 16
    assert mooncake_pages(decode, "loaded") - loaded == prompt_pages  # every page came over Mooncake
    deadline = time.monotonic() + 10  # a replica publishes its counters at its next idle tick
    while mooncake_pages(prefill, "stored") - stored < prompt_pages:
        assert time.monotonic() < deadline, "the prefill replica should have stored the prompt's pages"
        time.sleep(0.1)
    with pd.openai().chat.completions.with_streaming_response.create(  # streamed, through the SDK
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "cache_salt": "streamed"}) as streamed:
        assert streamed.headers[PREFILL_HEADER] == prefill.base_url
        text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    reference_text = alone.openai().chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": "one-replica"}).choices[0].message.content
    assert text == reference_text
    assert router_metric(pd, "agentjax:router_pd_prefills_total") == 2
    assert router_metric(pd, "agentjax:router_pd_fallbacks_total") == 0


def test_a_killed_mooncake_master_degrades_pd_to_one_replica_with_a_log_line(cluster):
    """Acceptance 5: with the master gone the prefill replica cannot share pages; the decode replica
    serves the request whole, with the same tokens, and the router says so in its log."""
    prefill, decode, alone = cluster["replicas"]
    pd = cluster["pd"]
    model = pd.openai().models.list().data[0].id
    messages = pd_messages("Delete the dead code path.")
    reference, _ = greedy_tokens(alone.openai(), model, messages, body={"cache_salt": "one-replica"})
    cluster["master"].kill()
    tokens, raw = greedy_tokens(pd.openai(), model, messages, extra_headers={"X-Session-ID": "after-the-master"})
    assert tokens == reference
    assert raw.headers[REPLICA_HEADER] == decode.base_url and PREFILL_HEADER not in raw.headers
    assert router_metric(pd, "agentjax:router_pd_fallbacks_total") == 1
    assert "P/D fallback" in pd.log_path.read_text()


def test_a_replica_killed_mid_turn_loses_no_session_and_sends_no_duplicate_reply(cluster):
    router = cluster["sticky"]
    client = router.openai()
    model = client.models.list().data[0].id
    session = {"X-Session-ID": "doomed-session"}
    messages = chat_turns(["Write a long answer."])
    first = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2,
                                                            extra_headers=session)
    doomed = replica_of(cluster, first.headers[REPLICA_HEADER])
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                 {"role": "user", "content": "Go on, at length."}]

    def long_turn():
        return client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=600, temperature=0, extra_headers=session,
            extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(long_turn)
        deadline = time.monotonic() + 60
        while doomed.metric("agentjax:num_requests_running") < 1:  # the turn is on the doomed replica
            assert time.monotonic() < deadline and not in_flight.done()
            time.sleep(0.05)
        time.sleep(0.3)
        kill(doomed)
        raw = in_flight.result(timeout=CLIENT_TIMEOUT_S)
    reply = raw.parse()
    assert raw.headers[REPLICA_HEADER] != doomed.base_url
    assert reply.usage.completion_tokens == 600 and len(reply.choices) == 1
    assert router_metric(router, "agentjax:router_retries_total") == 1  # one retry, whatever broke
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Thanks."}]
    next_turn = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2,
                                                                extra_headers=session)
    assert next_turn.headers[REPLICA_HEADER] == raw.headers[REPLICA_HEADER]  # the session lives there now
    assert next_turn.parse().usage.prompt_tokens_details.cached_tokens >= 64


def test_the_router_answers_503_with_a_clear_message_once_no_replica_is_healthy(cluster):
    import openai

    for replica in cluster["replicas"]:
        if replica.process.poll() is None:
            kill(replica)
    client = cluster["sticky"].openai()
    with pytest.raises(openai.InternalServerError) as failure:
        client.chat.completions.create(model="preset:tiny-dense", max_tokens=2,
                                       messages=[{"role": "user", "content": "Anyone there?"}])
    assert failure.value.status_code == 503
    assert "no healthy replica" in failure.value.message
    assert httpx.get(f"{cluster['sticky'].base_url}/health", timeout=10).status_code == 503


def mooncake_pages(replica, what: str) -> float:
    """agentjax:kv_offload_pages_{stored,loaded}_total{tier="mooncake"} of a replica."""
    text = httpx.get(f"{replica.base_url}/metrics", timeout=10).text
    name = f'agentjax:kv_offload_pages_{what}_total{{tier="mooncake"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def router_metric(router, name: str) -> float:
    """The sum of a metric's samples over all its labels."""
    text = httpx.get(f"{router.base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))

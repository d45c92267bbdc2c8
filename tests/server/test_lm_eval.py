"""lm-evaluation-harness's `local-completions` model against the live server, offline, on two local tasks
(tests/server/lm_eval_tasks): its loglikelihoods equal those LLM.score gives to 1e-4, and its greedy
generations equal LLM.generate's. It tokenizes through the server (/tokenizer_info, /tokenize), sends token
ids with echo and logprobs, and reads the legacy logprobs shape back."""

import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")


TASKS = Path(__file__).with_name("lm_eval_tasks")


@pytest.fixture(scope="module")
def evaluation(server, monkeypatch_module):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.chdir(TASKS)  # the task files name their data relative to their folder
    return simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.url + "/v1/completions", "model": "tiny", "num_concurrent": 1,
                    "max_retries": 1, "batch_size": 3},
        tasks=["deltaserve_tiny_mc", "deltaserve_tiny_gen"], task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True, cache_requests=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def pair(arguments) -> tuple[str, str]:
    """A request's (context, continuation), as lm-eval logs it (a tuple, or numbered args)."""
    if isinstance(arguments, dict):
        return arguments["arg_0"], arguments["arg_1"]
    return tuple(arguments[:2])


def reference_loglikelihood(llm, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (the continuation's tokens are those the whole text has after the context's), scored
    by one pass of LLM.score."""
    whole, ctx = llm.tokenizer.encode(context + continuation), llm.tokenizer.encode(context)
    logp = llm.score(whole).double().log_softmax(-1)
    rows = range(len(ctx) - 1, len(whole) - 1)
    return (sum(float(logp[i, whole[i + 1]]) for i in rows),
            all(int(logp[i].argmax()) == whole[i + 1] for i in rows))


def test_loglikelihoods_equal_llm_score(evaluation, reference):
    samples = evaluation["samples"]["deltaserve_tiny_mc"]
    assert len(samples) == 5
    for sample in samples:
        args = [pair(a) for a in sample["arguments"]]
        assert len(args) == len(sample["doc"]["choices"])
        for (context, continuation), resp in zip(args, sample["resps"]):
            ll, greedy = resp[0]
            expected, expected_greedy = reference_loglikelihood(reference, context, continuation)
            assert abs(ll - expected) < 1e-4, (context, continuation)
            assert bool(greedy) == expected_greedy
    acc = evaluation["results"]["deltaserve_tiny_mc"]["acc,none"]
    assert 0 <= acc <= 1 and not math.isnan(acc)


def test_generations_equal_llm_generate(evaluation, reference):
    samples = evaluation["samples"]["deltaserve_tiny_gen"]
    assert len(samples) == 3
    for sample in samples:
        prompt = pair(sample["arguments"][0])[0]  # (context, generation settings)
        expected = reference.generate(prompt, max_tokens=8, temperature=0, stop=["\n"]).text
        assert sample["resps"][0][0] == expected

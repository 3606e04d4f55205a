from pathlib import Path

import pytest
from mars.model_pool import PoolFileError, load_pool

REPO = Path(__file__).resolve().parents[2]


def test_shipped_local_pool_loads_with_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_LOCAL_LLM_URL", "http://127.0.0.1:1234")
    pool = load_pool(REPO / "config" / "models.local.yaml")
    assert len(pool.arms) >= 2
    assert pool.models[0].base_url == "http://127.0.0.1:1234/v1"
    short = pool.get("smollm2-135m-short")
    assert short.input_budget == short.context_window - short.output_reserve - short.safety_margin
    assert short.cost_usd(1_000_000, 0) == pytest.approx(short.input_price_per_m)
    assert pool.fallbacks_after(pool.arms[0]) == pool.arms[1:]


def test_default_applies_when_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARS_LOCAL_LLM_URL", raising=False)
    assert load_pool(REPO / "config" / "models.local.yaml").models[0].base_url == "http://127.0.0.1:8080/v1"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("models: []", "invalid"),
        (
            "models:\n  - name: a\n    base_url: x\n    context_window: 100\n    output_reserve: 90\n"
            "    safety_margin: 20\n    input_price_per_m: 0\n    output_price_per_m: 0\n",
            "exceed",
        ),
        ("models: [", "not valid YAML"),
        ("models:\n  - name: a\n    base_url: ${NOT_SET_ANYWHERE}\n", "NOT_SET_ANYWHERE"),
    ],
)
def test_bad_pool_files_fail_clearly(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(body)
    with pytest.raises(PoolFileError, match=message):
        load_pool(path)


def test_missing_pool_file(tmp_path: Path) -> None:
    with pytest.raises(PoolFileError, match="cannot read"):
        load_pool(tmp_path / "nope.yaml")


def test_cheapest_first_orders_by_price(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_LOCAL_LLM_URL", "http://x")
    pool = load_pool(REPO / "config" / "models.local.yaml")
    assert pool.cheapest_first() == ["smollm2-135m-short", "smollm2-135m-long"]


def test_paper_pool_has_table10_prices_and_exact_cost_arithmetic() -> None:
    from pathlib import Path

    from mars.model_pool import load_pool

    pool = load_pool(Path(__file__).parents[2] / "config" / "models.paper.yaml")
    prices = {m.name: (m.input_price_per_m, m.output_price_per_m) for m in pool.models}
    assert prices == {
        "llama-3.2-3b": (0.05, 0.10),
        "mixtral-8x7b": (0.20, 0.20),
        "qwen2.5-72b": (0.35, 0.40),
        "gpt-4o": (2.50, 10.00),
    }
    # 12,345 prompt and 678 completion tokens, by hand: 12345 * 2.50 / 1e6 + 678 * 10.00 / 1e6.
    assert pool.get("gpt-4o").cost_usd(12_345, 678) == pytest.approx(0.0308625 + 0.00678, abs=1e-15)
    assert pool.get("llama-3.2-3b").cost_usd(1_000_000, 1_000_000) == pytest.approx(0.15, abs=1e-15)
    assert pool.cheapest_first()[0] == "llama-3.2-3b" and pool.cheapest_first()[-1] == "gpt-4o"


ARM = (
    "models:\n  - name: a\n    base_url: {url}\n    context_window: 1000\n    output_reserve: 100\n"
    "    safety_margin: 10\n    input_price_per_m: 0\n    output_price_per_m: 0\n{extra}"
)


@pytest.mark.parametrize(
    "name", ["PGPASSWORD", "MARS_KAFKA_SASL_PASSWORD", "MARS_API_KEY", "HOME", "openai_api_key"]
)
def test_api_key_env_names_a_provider_key_never_a_mars_secret(tmp_path: Path, name: str) -> None:
    """The arm's key is sent to its endpoint as a bearer token: a pool naming the Postgres password, the Kafka
    password or a tenant's MARS key would hand it to whatever base_url says."""
    path = tmp_path / "pool.yaml"
    path.write_text(ARM.format(url="http://x/v1", extra=f"    api_key_env: {name}\n"))
    with pytest.raises(PoolFileError):
        load_pool(path)
    path.write_text(ARM.format(url="http://x/v1", extra="    api_key_env: OPENAI_API_KEY\n"))
    assert load_pool(path).models[0].api_key_env == "OPENAI_API_KEY"


def test_a_variables_value_is_one_scalar_never_more_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """${VAR} is expanded after parsing: a value with a newline and YAML in it stays the URL's text instead of
    adding keys to the arm."""
    monkeypatch.setenv("POOL_URL", "http://x/v1\n    api_key_env: STOLEN_API_KEY")
    path = tmp_path / "pool.yaml"
    path.write_text(ARM.format(url="${POOL_URL}", extra=""))
    arm = load_pool(path).models[0]
    assert arm.api_key_env is None
    assert arm.base_url == "http://x/v1\n    api_key_env: STOLEN_API_KEY"
    # A variable mentioned only in a comment is no longer required.
    path.write_text(
        "# set ${NOT_SET_ANYWHERE} for the hosted arm\n" + ARM.format(url="http://x/v1", extra="")
    )
    assert load_pool(path).arms == ["a"]

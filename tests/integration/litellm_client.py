"""The LiteLLM SDK as a client of the MARS gateway, run by test_gateway.py with LiteLLM's own virtual
environment (load-tests/.venv-litellm, `make litellm`): one completion per way of naming the end user.

    python litellm_client.py BASE_URL API_KEY PREFIX   ->  {"<way>": "ok" | "<error class>: <message>", ...}

The user of way W is PREFIX-W, so the caller can find each turn's user in the database."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet

import litellm


def main() -> None:
    base_url, key, prefix = sys.argv[1:4]
    ways: dict[str, dict[str, object]] = {
        "header": {"extra_headers": {"X-MARS-User": f"{prefix}-header"}},
        "safety_identifier": {"safety_identifier": f"{prefix}-safety_identifier"},
        "metadata": {"extra_body": {"metadata": {"user_id": f"{prefix}-metadata"}}},
        "extra_body_user": {"extra_body": {"user": f"{prefix}-extra_body_user"}},
        "user": {"user": f"{prefix}-user"},  # LiteLLM drops it before the request leaves
    }
    out: dict[str, str] = {}
    for way, kwargs in ways.items():
        try:
            litellm.completion(
                model="openai/mars",
                api_base=base_url,
                api_key=key,
                messages=[{"role": "user", "content": f"Say hello ({way})."}],
                max_tokens=8,
                num_retries=0,
                **kwargs,  # type: ignore[arg-type]
            )
            out[way] = "ok"
        except Exception as exc:  # the test reads the class and the message
            out[way] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()

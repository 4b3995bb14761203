"""The two coding agents end to end on the embedded model: OpenAI Codex CLI
(``codex exec``, a custom provider with ``wire_api = "responses"``) and Claude
Code (``claude -p``, ``ANTHROPIC_BASE_URL``), each completing one turn against
``exl3-sidecar serve`` with a tool offered to the model.

Both are installed at pinned versions from the npm registry by
``scripts/install_agents.sh`` into a cache directory; the download (about
800 MB unpacked) and two agent runs on a 2-core machine are why these tests
run only when asked::

    EXL3_SIDECAR_AGENT_TESTS=1 python -m pytest tests/e2e/test_coding_agents.py

Each agent is configured so that its prompt fits the embedded model's 8,192-token
context (short instructions, one or a few tools), with telemetry, update checks
and other traffic off; a dead HTTP(S) proxy for everything but 127.0.0.1 makes
any other network access fail instead of leaking. A recording pass-through
(``tests/e2e/recorder.py``) sits between each agent and the server, so the
tests assert what the agent sent and what it read back (its usage totals
equal the server's), not what the model happened to say.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Server
from tests.e2e.recorder import Exchange, recording

ENABLE_VAR = "EXL3_SIDECAR_AGENT_TESTS"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get(ENABLE_VAR) != "1",
        reason=f"installs Codex CLI and Claude Code from npm; set {ENABLE_VAR}=1 to run",
    ),
]

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install_agents.sh"
CODEX_VERSION = "0.171.0"
CLAUDE_CODE_VERSION = "2.1.332"
AGENT_TIMEOUT_S = 900
INSTRUCTIONS = "You are a coding assistant. Answer in one short sentence."
PROMPT = "Say hello."


def _offline_env(home: Path) -> dict[str, str]:
    """A clean environment: its own HOME, no credentials of the caller, and a
    proxy that refuses every connection except to this machine."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    dead = "http://127.0.0.1:9"
    env.update(
        HOME=str(home),
        HTTP_PROXY=dead,
        HTTPS_PROXY=dead,
        http_proxy=dead,
        https_proxy=dead,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


@pytest.fixture(scope="module")
def agents_dir() -> Path:
    if shutil.which("npm") is None:
        pytest.fail(f"{ENABLE_VAR}=1 but npm is not on PATH (node >= 18 and npm are needed)")
    cache = Path(os.environ.get("EXL3_SIDECAR_AGENTS_DIR", Path.home() / ".cache/exl3-sidecar/agents"))
    started = time.monotonic()
    subprocess.run(["bash", str(INSTALL), str(cache)], check=True, timeout=900)
    print(f"install_agents.sh: {time.monotonic() - started:.1f} s")
    return cache


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    work = tmp_path / "work"
    work.mkdir()
    (work / "README.md").write_text("A scratch project.\n")
    yield work


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=AGENT_TIMEOUT_S,
    )
    print(f"{Path(cmd[0]).name}: {time.monotonic() - started:.1f} s, exit {proc.returncode}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def _generations(exchanges: list[Exchange], path: str) -> list[Exchange]:
    calls = [e for e in exchanges if e.method == "POST" and e.path.split("?")[0] == path]
    assert calls, [(e.method, e.path) for e in exchanges]
    assert [e.status for e in calls] == [200] * len(calls), [bytes(e.response[:500]) for e in calls]
    return calls


CODEX_CONFIG = """\
model = "smol"
model_provider = "sidecar"
model_instructions_file = "{instructions}"
model_context_window = 8192
# Built-in tools that run on OpenAI's side and Codex's sub-agent tools (a
# 'namespace' tool): this server refuses both, naming them.
web_search = "disabled"
project_doc_max_bytes = 0
check_for_update_on_startup = false

[analytics]
enabled = false

[agents]
enabled = false

[features]
goals = false
apps = false
image_generation = false

[skills]
include_instructions = false

[model_providers.sidecar]
name = "exl3-sidecar"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


def test_codex_exec_completes_a_turn(server: Server, agents_dir: Path, workdir: Path, tmp_path: Path) -> None:
    codex = agents_dir / f"codex-{CODEX_VERSION}" / "node_modules" / ".bin" / "codex"
    home = tmp_path / "codex-home"
    home.mkdir()
    instructions = tmp_path / "instructions.md"
    instructions.write_text(INSTRUCTIONS + "\n")
    with recording(server.base_url) as (base_url, exchanges):
        (home / "config.toml").write_text(CODEX_CONFIG.format(instructions=instructions, base_url=base_url))
        env = _offline_env(tmp_path) | {"CODEX_HOME": str(home)}
        proc = _run(
            [str(codex), "exec", "--json", "--strict-config", "--skip-git-repo-check", PROMPT], env, workdir
        )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, kinds
    messages = [
        e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]
    assert messages and all(isinstance(m["text"], str) for m in messages)

    calls = _generations(exchanges, "/v1/responses")
    for call in calls:
        body = call.json()
        assert body["stream"] is True
        # Offered tools are function tools only, the shell among them.
        assert {t["type"] for t in body["tools"]} == {"function"}
        assert "exec_command" in {t["name"] for t in body["tools"]}
        assert INSTRUCTIONS in json.dumps(body["input"])
    # What Codex reports is what the server sent in each response.completed.
    finals = [
        d["response"]["usage"] for c in calls for d in c.sse_data() if d["type"] == "response.completed"
    ]
    assert len(finals) == len(calls)
    (usage,) = [e["usage"] for e in events if e["type"] == "turn.completed"]
    assert usage["input_tokens"] == sum(u["input_tokens"] for u in finals)
    assert usage["output_tokens"] == sum(u["output_tokens"] for u in finals)
    assert usage["cached_input_tokens"] == sum(u["input_tokens_details"]["cached_tokens"] for u in finals)


def test_claude_code_print_mode_completes_a_turn(
    server: Server, agents_dir: Path, workdir: Path, tmp_path: Path
) -> None:
    claude = agents_dir / f"claude-code-{CLAUDE_CODE_VERSION}" / "node_modules" / ".bin" / "claude"
    with recording(server.base_url) as (base_url, exchanges):
        env = _offline_env(tmp_path) | {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "unused",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            # Claude Code asks for 32,000 by default (clamped by the server) and
            # sends no temperature (the server's default is 1): a small cap and
            # greedy decoding (merged into each body) keep a 135M model from
            # rambling into the cap, which Claude Code retries three times and
            # then reports as an error.
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128",
            "CLAUDE_CODE_EXTRA_BODY": '{"temperature": 0}',
        }
        proc = _run(
            [
                str(claude),
                "-p",
                PROMPT,
                "--model",
                "smol",
                "--output-format",
                "json",
                "--max-turns",
                "1",
                # Its own system prompt, tool set (about 20 tools) and context notes
                # come to 12,201 tokens (docs/compatibility.md): replaced by short
                # instructions and one tool.
                "--bare",
                "--system-prompt",
                INSTRUCTIONS,
                "--tools",
                "Bash",
                "--strict-mcp-config",
                "--disable-slash-commands",
                "--no-session-persistence",
            ],
            env,
            workdir,
        )
    result = json.loads(proc.stdout)
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert result["is_error"] is False and isinstance(result["result"], str), result

    calls = _generations(exchanges, "/v1/messages")
    for call in calls:
        assert call.path == "/v1/messages?beta=true"
        body = call.json()
        assert body["stream"] is True and body["max_tokens"] == 128 and body["temperature"] == 0
        assert [t["name"] for t in body["tools"]] == ["Bash"]
        assert INSTRUCTIONS in json.dumps(body["system"])
    # Claude Code's totals are the sums of the usage each message_delta carried.
    finals = [d["usage"] for c in calls for d in c.sse_data() if d["type"] == "message_delta"]
    assert len(finals) == len(calls)
    usage = result["usage"]
    assert usage["input_tokens"] == sum(u["input_tokens"] for u in finals)
    assert usage["output_tokens"] == sum(u["output_tokens"] for u in finals)
    assert usage["cache_read_input_tokens"] == sum(u["cache_read_input_tokens"] for u in finals)

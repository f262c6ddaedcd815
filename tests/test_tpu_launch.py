"""tpu_scripts/launch.sh against a fake `gcloud` that records its arguments: the commands it runs for a single-host
and a multi-host slice are the ones docs/tpu.md shows, and it fails early with one line when it cannot work."""

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tpu_scripts" / "launch.sh"
FAKE_GCLOUD = r'''#!/usr/bin/env python3
import os, shlex, sys
log = os.environ["FAKE_GCLOUD_LOG"]
created = os.path.exists(log) and " create " in open(log).read()
with open(log, "a") as f:
    f.write(shlex.join(["gcloud", *sys.argv[1:]]) + "\n")
args = sys.argv[1:]
if args[:2] == ["auth", "list"]:
    print(os.environ.get("FAKE_GCLOUD_ACCOUNT", ""))
elif args[:2] == ["config", "get-value"]:
    print("my-project")
elif "describe" in args:  # nothing exists until it is created; a queued resource is ACTIVE at once
    if not created:
        sys.exit(1)
    print("ACTIVE" if "queued-resources" in args else "READY")
'''
# the two documented launches: (docs marker, launch.sh arguments)
SINGLE = ("v5e-8", ["train", "--zone=us-west4-a", "--name=corl-v5e8", "--accelerator-type=v5e-8",
                    "--config=configs/ring3.py", "--workdir=gs://my-bucket/runs/ring3-v5e8", "--",
                    "--config.mesh.fsdp=8"])
MULTI = ("v5p-32", ["train", "--project=my-project", "--zone=us-east5-a", "--name=corl-v5p32",
                    "--accelerator-type=v5p-32", "--queued", "--spot", "--config=configs/pair_different_family.py",
                    "--workdir=gs://my-bucket/runs/pair-v5p32", "--", "--config.placement=partitioned"])
PROBES = re.compile(r"^gcloud (auth list|config get-value|compute tpus (tpu-vm|queued-resources) describe) ")


def documented(marker: str) -> list[str]:
    """The command block that follows `<!-- launch.sh MARKER -->` in docs/tpu.md."""
    text = (ROOT / "docs" / "tpu.md").read_text()
    block = re.search(rf"<!-- launch.sh {re.escape(marker)} -->\n```bash\n(.*?)```", text, re.S)
    assert block, f"docs/tpu.md has no block for {marker}"
    return block.group(1).strip().splitlines()


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"

    def launch(*args, account="me@example.com", path=None):
        env = {"PATH": path or f"{bin_dir}:{os.environ['PATH']}", "FAKE_GCLOUD_LOG": str(log),
               "FAKE_GCLOUD_ACCOUNT": account, "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
        run = subprocess.run(["/bin/bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                             timeout=120)
        calls = log.read_text().replace(str(tmp_path), "/tmp").splitlines() if log.exists() else []
        return run, calls

    return launch


@pytest.mark.parametrize("marker, args", [SINGLE, MULTI], ids=["single-host", "multi-host"])
def test_runs_the_documented_commands(marker, args, fake, tmp_path):
    run, calls = fake(*args)
    assert run.returncode == 0, run.stderr
    assert [c for c in calls if not PROBES.match(c)] == documented(marker)
    assert calls[0] == "gcloud auth list --filter=status:ACTIVE '--format=value(account)'"
    name = next(a.split("=")[1] for a in args if a.startswith("--name="))
    with tarfile.open(tmp_path / f"corl_jax-{name}.tgz") as shipped:  # the checkout went out
        names = shipped.getnames()
    assert {"pyproject.toml", "corl_jax/train.py", "tpu_scripts/launch.sh"} <= set(names)
    # the dry run prints the same commands and calls nothing
    project = [] if "--project=my-project" in args else ["--project=my-project"]  # a dry run cannot ask gcloud
    dry, after = fake("--dry-run", *project, *args)
    printed = dry.stdout.replace(str(tmp_path), "/tmp").splitlines()
    assert dry.returncode == 0 and printed == documented(marker) and after == calls


def test_multi_host_run_is_distributed_and_single_host_is_not():
    single, multi = (" ".join(documented(m)) for m in ("v5e-8", "v5p-32"))
    assert "--distributed" in multi and "--distributed" not in single


@pytest.mark.parametrize("args, account, problem", [
    (MULTI[1][:-2] + ["--workdir=/tmp/ring3"], "me@example.com",
     "v5p-32 has 4 hosts: --workdir must be on shared storage (gs://BUCKET/PATH)"),
    (SINGLE[1], "", "gcloud has no active account; run 'gcloud auth login'"),
    (["train", "--zone=z", "--name=n", "--accelerator-type=v9-8", "--config=c", "--workdir=w"], "me@example.com",
     "unknown accelerator type 'v9-8'"),
], ids=["local-workdir-on-a-pod", "not-logged-in", "bad-type"])
def test_fails_early_with_one_line(args, account, problem, fake):
    run, calls = fake(*args, account=account)
    assert run.returncode == 2 and problem in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not [c for c in calls if " create " in c or " ssh " in c or " scp " in c]


def test_fails_early_without_gcloud(fake, tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("dirname",):
        (tools / tool).symlink_to(shutil.which(tool))
    run, calls = fake(*SINGLE[1], path=str(tools))
    assert run.returncode == 2 and run.stderr.strip() == (
        "launch.sh: error: gcloud not found on PATH; install the Google Cloud CLI "
        "(https://cloud.google.com/sdk/docs/install)") and calls == []

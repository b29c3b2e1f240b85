"""Issue 62: the operator's own upgrade does not break the jobs that run under it. What it writes for a running job's
pods is read by that job's image, here the previous release's `rmsft serve` parser vendored from git history
(tests/operator/fixtures/serve_config_7b46b7c.py, commit 7b46b7c: it refuses any key it does not know)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from rmsft_operator import render
from rmsft_operator.reconcile import decide
from test_operator_decide import _STARTED, NOW, World, _spec  # tests/operator is on sys.path (rootdir conftest)

from rmsft.jobspec import parse_job

FIXTURE = Path(__file__).parent / "fixtures/serve_config_7b46b7c.py"


def _previous_parser() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_rmsft_previous_serve_config", FIXTURE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _as_previous_release_wrote_it(serve_yaml: str, previous: ModuleType) -> str:
    """serve.yaml as the previous operator rendered it: the keys its `rmsft serve` knows (it rendered no other)."""
    from dataclasses import fields

    known = {f.name for f in fields(previous.ServeConfig)}
    return yaml.safe_dump({k: v for k, v in yaml.safe_load(serve_yaml).items() if k in known}, sort_keys=False)


def _read(previous: ModuleType, serve_yaml: str, tmp_path: Path) -> object:
    doc = yaml.safe_load(serve_yaml)
    doc["model"] = str(tmp_path)  # the model folder must exist for validate()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    return previous.parse_config(["--config", str(path)])


def test_the_previous_releases_serve_parser_reads_what_this_operator_writes_for_a_running_job(tmp_path: Path) -> None:
    """A job applied under the previous release: its ConfigMap's serve.yaml has no relay_allow, its pods keep the
    previous image. Before, this operator rewrote serve.yaml to what it renders (relay_allow and other keys new since),
    and the next server restart crash-looped on `unknown keys`. Now a running job's serve.yaml is never rewritten:
    every pass, the pool resized too, leaves the previous parser something it reads."""
    previous = _previous_parser()
    world = World(spec=_spec(**{"rollout.replicas": 3}), **_STARTED)
    obs = world.observed()
    cm = obs.children["ConfigMap"]
    assert cm is not None
    new_serve = cm["data"][render.SERVE_KEY]
    with pytest.raises(SystemExit, match="unknown keys"):  # the previous image cannot read what is rendered now
        _read(previous, new_serve, tmp_path)
    cm["data"][render.SERVE_KEY] = _as_previous_release_wrote_it(new_serve, previous)
    for replicas in (3, 2, 5):  # as applied, then the pool resized both ways (the server list is rewritten)
        obs.spec["rollout"]["replicas"] = replicas
        data = copy.deepcopy(cm["data"])
        for patch in decide(obs, NOW).patches:
            if patch.kind == "ConfigMap":
                data.update(patch.body["data"])
        assert data[render.SERVE_KEY] == cm["data"][render.SERVE_KEY]
        cfg = _read(previous, data[render.SERVE_KEY], tmp_path)
        assert cfg.port == yaml.safe_load(new_serve)["port"]  # type: ignore[attr-defined]


def test_this_releases_serve_parser_reads_a_serve_yaml_with_keys_it_does_not_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other way, decided once: from this release on, `rmsft serve` ignores a key it does not know, saying so,
    so a later operator's serve.yaml cannot crash-loop a job running this image."""
    from rollout_svc.config import parse_config

    job = parse_job(
        {
            "apiVersion": "rmsft.io/v1alpha1",
            "kind": "RolloutMatchingJob",
            "metadata": {"name": "demo", "namespace": "team-a"},
            "spec": _spec(),
        }
    )
    serve = render.serve_config(job, "team-a")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({**serve, "model": str(tmp_path), "a_key_from_a_later_release": 1}))
    cfg = parse_config(["--config", str(path)])
    assert cfg.port == serve["port"]
    assert "ignoring unknown keys" in capsys.readouterr().err


OLD_CRD = Path(__file__).parent / "fixtures/crd_7b46b7c.yaml"


class _Api:
    """The two calls crd_check makes: GET the CRD (answering `crd`, or `status`), POST an Event (recorded)."""

    def __init__(self, crd: dict | None, status: int = 200) -> None:
        self.crd, self.status, self.events = crd, status, []

    def request(self, method: str, path: str, body: object = None, expected: tuple[int, ...] = ()) -> object:
        from rmsft_operator.kube import ApiError

        if method == "POST":
            self.events.append((path, body))
            return body
        if self.status != 200 or self.crd is None:
            raise ApiError(404 if self.crd is None and self.status == 200 else self.status, f"GET {path}")
        return self.crd


def test_an_older_crd_is_named_with_what_it_would_prune_or_refuse(caplog: pytest.LogCaptureFixture) -> None:
    """The previous release's CRD (from git history) against this operator's: the status fields it would prune on
    every write (learnerAttempt: unbounded attempts) are named, with the fix; the operator's own CRD is no mismatch."""
    from rmsft_operator import crd_check
    from rmsft_operator.crd import build_crd

    own = build_crd()
    assert crd_check.mismatch(own, own) == ""
    old = yaml.safe_load(OLD_CRD.read_text())
    said = crd_check.mismatch(old, own)
    assert "older than this operator" in said and "status.learnerAttempt" in said and "pruned" in said
    assert "kubectl apply --server-side -f charts/rmsft/crds/rolloutmatchingjobs.yaml" in said
    # A condition type the old schema's enum lacks is named as refused (422).
    fewer = copy.deepcopy(own)
    cond = fewer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "conditions"
    ]["items"]["properties"]["type"]
    cond["enum"] = [t for t in cond["enum"] if t != "CheckpointsDurable"]
    assert "condition types it refuses" in crd_check.mismatch(
        fewer, own
    ) and "CheckpointsDurable" in crd_check.mismatch(fewer, own)
    # check(): an error in the log and one Warning Event in the operator's namespace.
    api = _Api(old)
    with caplog.at_level("ERROR", logger="rmsft_operator.crd_check"):
        assert crd_check.check(api, "rmsft-system", own) == said  # type: ignore[arg-type]
    assert said in caplog.text
    ((path, event),) = api.events
    assert path == "/api/v1/namespaces/rmsft-system/events"
    assert (event["type"], event["reason"]) == ("Warning", "CRDVersionMismatch")  # type: ignore[index]
    assert event["involvedObject"]["name"] == "rolloutmatchingjobs.rmsft.io"  # type: ignore[index]
    # Its own CRD: nothing posted; an unreadable one (403): not checked, said in the log, no crash.
    same = _Api(own)
    assert crd_check.check(same, "rmsft-system", own) == "" and same.events == []  # type: ignore[arg-type]
    assert crd_check.check(_Api(own, 403), "rmsft-system", own) == ""  # type: ignore[arg-type]


def test_docs_upgrade_says_what_the_code_does() -> None:
    """docs/upgrade.md: its commands and names are the code's (the fix the operator prints, the chart's values and
    its refusal of the old key, the vendored fixtures)."""
    from rmsft_operator import crd_check

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs/upgrade.md").read_text()
    assert crd_check.FIX.split(": ", 1)[1].split(" (")[0] in text  # the kubectl apply the operator prints
    assert crd_check.REASON in text and "get events" in text
    values = yaml.safe_load((root / "charts/rmsft/values.yaml").read_text())
    assert values["rbac"]["clusterWide"] is False and "namespaced" not in values["rbac"]
    assert "rbac.clusterWide=true" in text and "rbac.watchNamespaces" in text
    deployment = (root / "charts/rmsft/templates/deployment.yaml").read_text()
    assert "rbac.namespaced is gone" in deployment and "docs/upgrade.md" in deployment
    for fixture in ("tests/operator/fixtures/serve_config_7b46b7c.py", "charts/rmsft/crds/rolloutmatchingjobs.yaml"):
        assert fixture in text and (root / fixture).exists()
    from rollout_svc import config

    assert "ignoring unknown keys" in Path(config.__file__).read_text() and "ignoring unknown keys" in text

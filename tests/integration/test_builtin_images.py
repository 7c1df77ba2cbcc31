"""The built-in python-data image: numpy and pandas warm in every child."""

from __future__ import annotations

import httpx
import pytest

from forkd.guest import image as images

from .conftest import Daemon

pytestmark = pytest.mark.integration


def test_python_data_children_start_warm(daemon: Daemon) -> None:
    images.build("python-data")  # cached after the first build
    c = httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=600
    )
    with c:
        r = c.post("/v1/snapshots", json={"tag": "pydata", "image": "python-data"})
        assert r.status_code == 201, r.text
        assert r.json()["memory_mib"] == 512  # the recipe's template default
        (kid,) = c.post("/v1/sandboxes", json={"snapshot_tag": "pydata"}).json()
        sid = kid["id"]
        # No import here: the recipe's warmup ran in the template.
        res = c.post(f"/v1/sandboxes/{sid}/eval", json={"code": "numpy.zeros(5).sum()"}).json()
        assert res["error"] is None
        assert res["result"] in ("0.0", "np.float64(0.0)")  # numpy 1 / numpy 2 repr
        res = c.post(
            f"/v1/sandboxes/{sid}/eval",
            json={"code": "pandas.DataFrame({'a': [1, 2, 3]})['a'].sum()"},
        ).json()
        assert res["result"] in ("6", "np.int64(6)"), res
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert c.delete("/v1/snapshots/pydata").status_code == 204

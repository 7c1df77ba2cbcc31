"""Workspaces (the original forkd's): create, list, suspend, resume, delete."""

from __future__ import annotations

from forkd.client.connection import JSONDict
from forkd.client.route_base import Call, RouteBase, drop_none, no_answer, quote_segment, route


class WorkspaceCalls(RouteBase):
    """The JSON routes of workspaces (:class:`~forkd.client.routes.Routes`)."""

    # -- workspaces (the original forkd's) -----------------------------------

    @route
    def list_workspaces(self) -> Call[list[JSONDict]]:
        """``GET /v1/workspaces`` → list of WorkspaceInfo, by name."""
        return self._json("GET", "/v1/workspaces")

    @route
    def create_workspace(
        self,
        name: str,
        snapshot_tag: str,
        per_child_netns: bool | None = None,
        memory_limit_mib: int | None = None,
    ) -> Call[JSONDict]:
        """``POST /v1/workspaces``: fork one sandbox of ``snapshot_tag`` as workspace
        ``name`` → WorkspaceInfo (``status`` ``"running"``, ``live_sandbox_id``)."""
        body = drop_none(
            {
                "name": name,
                "snapshot_tag": snapshot_tag,
                "per_child_netns": per_child_netns,
                "memory_limit_mib": memory_limit_mib,
            }
        )
        return self._json("POST", "/v1/workspaces", json_body=body)

    @route
    def get_workspace(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/workspaces/{quote_segment(name)}")

    @route
    def delete_workspace(self, name: str) -> Call[None]:
        """``DELETE /v1/workspaces/{name}``: its sandbox is killed, whatever its state."""
        return self._request("DELETE", f"/v1/workspaces/{quote_segment(name)}").then(no_answer)

    @route
    def suspend_workspace(self, name: str) -> Call[JSONDict]:
        """Hibernate the workspace's sandbox (``status`` ``"suspended"``)."""
        return self._json(
            "POST",
            f"/v1/workspaces/{quote_segment(name)}/suspend",
            json_body={},
            timeout=max(self.timeout, 600),
        )

    @route
    def resume_workspace(self, name: str) -> Call[JSONDict]:
        """Wake it (the same sandbox), or fork anew from its source when it is stale."""
        return self._json(
            "POST",
            f"/v1/workspaces/{quote_segment(name)}/resume",
            json_body={},
            timeout=max(self.timeout, 600),
        )

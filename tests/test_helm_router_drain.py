"""The chart drains the router as `kvmesh router --shutdown-timeout` does: the grace period left
after the preStop sleep, less a margin to exit in."""

from __future__ import annotations

import pytest

from tests.test_helm_chart import RELEASE, container, flag, one, render_values


@pytest.mark.parametrize(
    ("grace", "sleep", "timeout"), [(60, 10, "45"), (300, 0, "295"), (10, 10, "0")]
)
def test_router_shutdown_timeout_fits_the_grace_period(grace: int, sleep: int, timeout: str):
    router = {"terminationGracePeriodSeconds": grace, "preStopSleepSeconds": sleep}
    docs = render_values({"router": router})
    deployment = one(docs, "Deployment", f"{RELEASE}-kvmesh-router")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    assert flag(container(deployment)["args"], "--shutdown-timeout") == timeout

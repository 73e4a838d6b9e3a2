"""The supervisor's backoff: 1 s, doubling per death in a row up to 30 s, per role, back to
1 s once a child served for a minute."""
from specmesh_services.launch.supervisor import Backoff


def test_restart_delays_double_per_role_and_reset_after_a_healthy_minute():
    backoff = Backoff()
    assert [backoff.next("verifier", 0.5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next("router", 0.5) == 1, "each role backs off on its own"
    assert backoff.next("verifier", 61.0) == 1, "it had served a minute"
    assert backoff.restarts == {"verifier": 8, "router": 1}

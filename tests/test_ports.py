"""A port taken between `specmesh up` choosing it and a child binding it: the child's error
names it in words `up` recognizes, so the stage starts again on new ports."""
import asyncio
import socket

import pytest

from specmesh_services.common.rpc import start_server
from specmesh_services.launch.stack import PORT_TAKEN


def test_a_taken_port_fails_the_server_with_a_message_up_retries_on():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def start():
            server, _ = await start_server([], "127.0.0.1", port)
            await server.stop(None)

        with pytest.raises(OSError) as failure:
            asyncio.run(start())
    assert f"cannot listen on 127.0.0.1:{port}" in str(failure.value)
    assert any(marker in str(failure.value) for marker in PORT_TAKEN)

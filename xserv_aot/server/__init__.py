"""OpenAI-compatible HTTP server over an AsyncEngineProtocol engine."""
from xserv_aot.server.app import create_app
from xserv_aot.server.run import DrainingServer, run_server, server_config

__all__ = ["create_app", "run_server", "server_config", "DrainingServer"]

"""Serve one OpenStack WSGI application with gunicorn on 127.0.0.1.

Usage: wsgi_serve.py MODULE:ATTRIBUTE PORT

The OpenStack wheels no longer ship eventlet API servers, only `*.wsgi.*`
modules meant for uWSGI or mod_wsgi. gunicorn is pure Python, so it installs
from PyPI without a compiler. Started by `cargo xtask openstack up`, which
points each service at its configuration through OS_<SERVICE>_CONFIG_DIR.
"""

import importlib
import sys

from gunicorn.app.base import BaseApplication


class _Server(BaseApplication):
    def __init__(self, app_ref, port):
        self.app_ref = app_ref
        self.port = port
        super().__init__()

    def load_config(self):
        settings = {
            "bind": f"127.0.0.1:{self.port}",
            # One process with threads: enough for tests, and the memory of a
            # second worker (100-200 MiB each) is better spent elsewhere.
            "workers": 1,
            "worker_class": "gthread",
            "threads": 8,
            "timeout": 300,
            # `cargo xtask openstack down` sends SIGTERM: finish in-flight requests, but do not wait 30 s.
            "graceful_timeout": 5,
            # gunicorn's default keep-alive (2 s) equals common client poll
            # intervals: a client then reuses a socket the server is closing and
            # gets "Remote end closed connection without response".
            "keepalive": 75,
            "proc_name": self.app_ref,
            "accesslog": "-",
            "errorlog": "-",
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self):
        module, attr = self.app_ref.split(":", 1)
        return getattr(importlib.import_module(module), attr)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    app_ref, port = sys.argv[1], int(sys.argv[2])
    # The WSGI modules parse sys.argv with oslo.config, which rejects unknown
    # arguments: hide ours before the application is imported.
    sys.argv = [sys.argv[0]]
    _Server(app_ref, port).run()


if __name__ == "__main__":
    main()

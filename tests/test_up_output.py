"""What `mfs up` prints last: a one-line curl that works against the gateway it started."""
from __future__ import annotations

import json
import shlex
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from mfs.up import try_command


class Models(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = json.dumps({"data": [{"id": "fam-small"}, {"id": "fam-large"}, {"id": "fam"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_the_try_line_is_a_chat_request_to_the_family_id():
    srv = HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        argv = shlex.split(try_command(url))
    finally:
        srv.shutdown()
    assert argv[:3] == ["curl", "-s", url + "/v1/chat/completions"]
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "fam" and body["messages"][0]["role"] == "user"


def test_without_a_models_list_the_line_says_where_the_name_goes():
    line = try_command("http://127.0.0.1:9")  # nothing listens on the discard port
    assert json.loads(shlex.split(line)[-1])["model"] == "MODEL"

"""Kill -9 the server in the middle of a stream of PATCHes: the rc file stays whole."""

import http.client
import json
import random
import signal
import threading
import time
import urllib.error
import urllib.request

import yaml
from conftest import run_foreground_server


def patch_forever(url, sent, stop):
    i = 0
    while not stop.is_set():
        i += 1
        body = {"proxy_username": f"user{i}", "no_proxy": f"host{i}"}
        sent.append(i)
        req = urllib.request.Request(url + "/v1/configs", method="PATCH",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            return


def test_kill_9_during_patches_leaves_old_or_new_state(home):
    servers = []
    try:
        check_kill_9(home, servers)
    finally:
        for srv in servers:
            if srv.process.poll() is None:
                srv.process.kill()
                srv.process.wait()


def check_kill_9(home, servers):
    rng = random.Random(1234)
    for _ in range(4):
        srv = run_foreground_server(home)
        servers.append(srv)
        sent, stop = [], threading.Event()
        workers = [threading.Thread(target=patch_forever, args=(srv.url, sent, stop))
                   for _ in range(2)]
        for w in workers:
            w.start()
        time.sleep(rng.uniform(0.2, 0.6))
        srv.process.send_signal(signal.SIGKILL)
        srv.process.wait(timeout=10)
        stop.set()
        for w in workers:
            w.join(timeout=10)
        srv.process.stdout.close()
        srv.process.stderr.close()
        assert len(sent) > 5, "the PATCH stream never got going"

        data = yaml.safe_load(srv.settings.path.read_text())  # must parse
        user, hosts = data["proxyUsername"], data["noProxy"]
        # Both fields come from one PATCH: either still the first state or one whole update.
        if user == "":
            assert hosts == "localhost,127.0.0.1,::1" or hosts.startswith("host")
        else:
            n = int(user[len("user"):])
            assert hosts == f"host{n}" and n in sent
        assert data["apiServerPort"] == 39281 and data["cors"] is True
        # The next server starts on the same file and reads those values.
        srv = run_foreground_server(home)
        servers.append(srv)
        with urllib.request.urlopen(srv.url + "/v1/configs") as r:
            assert json.loads(r.read())["proxy_username"] == user
        srv.stop()
        srv.process.stdout.close()
        srv.process.stderr.close()

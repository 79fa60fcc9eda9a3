"""A stand-in for `aws ssm start-session`, `gcloud compute ssh` and `ssh -L` (none
of which can reach a cloud from here): it reads the local port to listen on and
the remote port from the arguments each real tool takes, and relays every
connection to FAKE_TUNNEL_TARGET (a real etcd on this machine standing for the
instance's). Its argv and pid go to FAKE_TUNNEL_LOG, one JSON line."""
import json
import os
import re
import socket
import sys
import threading


def ports(tool: str, argv: list[str]) -> tuple[int, int]:
    """(local, remote) as the real tool would read them."""
    if tool == "aws":
        params = dict(p.split("=") for p in argv[argv.index("--parameters") + 1].split(","))
        return int(params["localPortNumber"]), int(params["portNumber"])
    forward = argv[argv.index("-L") + 1]
    local, remote = re.fullmatch(r"127\.0\.0\.1:(\d+):[^:]+:(\d+)", forward).groups()
    return int(local), int(remote)


def pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main() -> None:
    tool, argv = os.path.basename(sys.argv[1]), sys.argv[2:]
    local, remote = ports(tool, argv)
    with open(os.environ["FAKE_TUNNEL_LOG"], "a") as f:
        f.write(json.dumps({"tool": tool, "argv": argv, "pid": os.getpid(), "remote": remote}) + "\n")
    host, _, port = os.environ["FAKE_TUNNEL_TARGET"].rpartition(":")
    server = socket.create_server(("127.0.0.1", local))
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection((host, int(port)))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    main()

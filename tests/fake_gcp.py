"""A small fake of the Compute Engine REST API on loopback: instance templates,
regional managed instance groups (insert, resize, listManagedInstances,
deleteInstances, delete), regions, machine and accelerator types, single
instances (the --etcd auto node; insert, get, stop, delete),
firewall rules
and long-running operations (RUNNING when returned, DONE once polled), so
the real google-cloud-compute client can be tested offline."""
import http.server
import itertools
import json
import re
import threading
from urllib.parse import parse_qs, urlparse

BASE = "/compute/v1/projects/(?P<project>[^/]+)"


class FakeCompute(http.server.ThreadingHTTPServer):
    def __init__(self, zones=("us-central1-a", "us-central1-b", "us-central1-c")):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.zones = zones
        self.templates: dict[str, dict] = {}
        self.groups: dict[str, dict] = {}
        self.instances: dict[str, dict] = {}   # name -> the inserted body (plus networkInterfaces' IP)
        self.firewalls: dict[str, dict] = {}
        self.machine_types = {"n1-standard-8", "n1-standard-4", "e2-small"}
        self.accelerator_types = {"nvidia-tesla-t4", "nvidia-l4"}
        self.operations: dict[str, dict] = {}
        self.polls = 0
        self.refuse: set[str] = set()   # "insert-group", ...: answered 403
        self.requests: list[tuple[str, str]] = []
        self.left: list[str] = []      # instances taken out of a group by deleteInstances
        self._ids = itertools.count(1)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def operation(self, kind: str, target: str, region: str | None, zone: str | None = None) -> dict:
        name = f"operation-{next(self._ids)}"
        op = {"kind": "compute#operation", "name": name, "status": "RUNNING", "operationType": kind,
              "targetLink": target, "progress": 0}
        if region:
            op["region"] = region
        if zone:
            op["zone"] = zone
        self.operations[name] = op
        return op


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def _route(self, method: str):
        s, url = self.server, urlparse(self.path)
        path, query = url.path, parse_qs(url.query)
        s.requests.append((method, path))
        region_base = BASE + "/regions/(?P<region>[^/]+)"
        zone_base = BASE + "/zones/(?P<zone>[^/]+)"
        routes = [
            ("GET", region_base + "$", self._region),
            ("GET", BASE + "/global/operations/(?P<op>[^/]+)$", self._poll),
            ("GET", region_base + "/operations/(?P<op>[^/]+)$", self._poll),
            ("POST", BASE + "/global/instanceTemplates$", self._insert_template),
            ("DELETE", BASE + "/global/instanceTemplates/(?P<name>[^/]+)$", self._delete_template),
            ("POST", region_base + "/instanceGroupManagers$", self._insert_group),
            ("POST", region_base + "/instanceGroupManagers/(?P<name>[^/]+)/resize$", self._resize),
            ("GET", region_base + "/instanceGroupManagers/(?P<name>[^/]+)$", self._get_group),
            ("POST", region_base + "/instanceGroupManagers/(?P<name>[^/]+)/listManagedInstances$", self._list),
            ("POST", region_base + "/instanceGroupManagers/(?P<name>[^/]+)/deleteInstances$", self._leave_group),
            ("POST", zone_base + "/instances/(?P<name>[^/]+)/stop$", self._stop_instance),
            ("DELETE", region_base + "/instanceGroupManagers/(?P<name>[^/]+)$", self._delete_group),
            ("GET", zone_base + "/machineTypes/(?P<name>[^/]+)$", self._machine_type),
            ("GET", zone_base + "/acceleratorTypes/(?P<name>[^/]+)$", self._accelerator_type),
            ("GET", zone_base + "/operations/(?P<op>[^/]+)$", self._poll),
            ("POST", zone_base + "/instances$", self._insert_instance),
            ("GET", zone_base + "/instances/(?P<name>[^/]+)$", self._get_instance),
            ("DELETE", zone_base + "/instances/(?P<name>[^/]+)$", self._delete_instance),
            ("POST", BASE + "/global/firewalls$", self._insert_firewall),
            ("DELETE", BASE + "/global/firewalls/(?P<name>[^/]+)$", self._delete_firewall),
        ]
        for verb, pattern, handler in routes:
            m = re.match(pattern, path)
            if verb == method and m:
                return handler(query=query, **m.groupdict())
        self._reply(404, {"error": {"code": 404, "message": f"no route {method} {path}"}})

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_DELETE(self):
        self._route("DELETE")

    # -- handlers -----------------------------------------------------------------------
    def _region(self, project, region, query):
        zones = [f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{z}" for z in self.server.zones]
        self._reply(200, {"kind": "compute#region", "name": region, "zones": zones})

    def _poll(self, project, op, query, region=None, zone=None):
        self.server.polls += 1
        found = self.server.operations.get(op)
        if not found:
            return self._reply(404, {"error": {"code": 404, "message": f"no operation {op}"}})
        found["status"], found["progress"] = "DONE", 100
        self._reply(200, found)

    def _refused(self, what: str) -> bool:
        if what in self.server.refuse:
            self._reply(403, {"error": {"code": 403, "message": f"QUOTA_EXCEEDED: {what} refused by the fake"}})
            return True
        return False

    def _insert_global(self, kind: str, store: dict) -> None:
        """A global resource (template, firewall rule): kept by name, or refused."""
        if self._refused(f"insert-{kind}"):
            return
        body = self._body()
        store[body["name"]] = body
        self._reply(200, self.server.operation("insert", body["name"], None))

    def _delete_global(self, store: dict, name: str) -> None:
        store.pop(name, None)
        self._reply(200, self.server.operation("delete", name, None))

    def _insert_template(self, project, query):
        self._insert_global("template", self.server.templates)

    def _delete_template(self, project, name, query):
        self._delete_global(self.server.templates, name)

    def _insert_group(self, project, region, query):
        if self._refused("insert-group"):
            return
        body = self._body()
        self.server.groups[body["name"]] = body
        self._reply(200, self.server.operation("insert", body["name"], region))

    def _resize(self, project, region, name, query):
        self.server.groups[name]["targetSize"] = int(query["size"][0])
        self._reply(200, self.server.operation("resize", name, region))

    def _get_group(self, project, region, name, query):
        if name not in self.server.groups:
            self._reply(404, {"error": {"code": 404, "message": f"instance group manager {name} not found"}})
            return
        self._reply(200, self.server.groups[name])

    def _list(self, project, region, name, query):
        group = self.server.groups[name]
        zones = [z["zone"].rsplit("/", 1)[-1] for z in group["distributionPolicy"]["zones"]]
        instances = [{"instance": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/"
                                  f"{zones[i % len(zones)]}/instances/{name}-{i:04d}",
                      "instanceStatus": "RUNNING", "currentAction": "NONE"} for i in range(group["targetSize"])]
        self._reply(200, {"managedInstances": instances})

    def _leave_group(self, project, region, name, query):
        """deleteInstances: the instances go, and the group's target size drops by as many."""
        gone = self._body()["instances"]
        self.server.groups[name]["targetSize"] -= len(gone)
        self.server.left.extend(gone)
        self._reply(200, self.server.operation("deleteInstances", name, region))

    def _stop_instance(self, project, zone, name, query):
        self.server.instances[name]["status"] = "TERMINATED"  # what a stopped instance shows
        self._reply(200, self.server.operation("stop", name, None, zone))

    def _delete_group(self, project, region, name, query):
        self.server.groups.pop(name, None)
        self._reply(200, self.server.operation("delete", name, region))

    def _known(self, kind: str, names: set, name: str) -> None:
        if name in names:
            return self._reply(200, {"name": name})
        self._reply(404, {"error": {"code": 404, "message": f"The resource '{kind}/{name}' was not found"}})

    def _machine_type(self, project, zone, name, query):
        self._known("machineTypes", self.server.machine_types, name)

    def _accelerator_type(self, project, zone, name, query):
        self._known("acceleratorTypes", self.server.accelerator_types, name)

    def _insert_instance(self, project, zone, query):
        if self._refused("insert-instance"):
            return
        body = self._body()
        body["networkInterfaces"][0]["networkIP"] = f"10.128.0.{len(self.server.instances) + 2}"
        body["zone"] = zone
        self.server.instances[body["name"]] = body
        self._reply(200, self.server.operation("insert", body["name"], None, zone))

    def _get_instance(self, project, zone, name, query):
        found = self.server.instances.get(name)
        self._reply(200, found) if found else self._reply(404, {"error": {"code": 404, "message": f"no {name}"}})

    def _delete_instance(self, project, zone, name, query):
        self.server.instances.pop(name, None)
        self._reply(200, self.server.operation("delete", name, None, zone))

    def _insert_firewall(self, project, query):
        self._insert_global("firewall", self.server.firewalls)

    def _delete_firewall(self, project, name, query):
        self._delete_global(self.server.firewalls, name)

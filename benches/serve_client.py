"""What the served-path benchmarks share: waiting for `flashrt serve` to be ready."""

import http.client


def health(port):
    """Whether `GET /health` on 127.0.0.1:`port` answers 200."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        c.request("GET", "/health")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False

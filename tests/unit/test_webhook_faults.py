"""A mistyped alert webhook or an endpoint that is not HTTP is a failed attempt: the sender thread
lives on and the token never reaches a log (found by an outside review)."""
from __future__ import annotations

import logging
import threading
import time

from pipeline import webhook

HOOK = "hooks.example.com/services/T000/B000/s3cr3tT0ken"  # the slip: no https://


def test_a_webhook_without_a_scheme_is_an_error_not_an_exception_and_hides_its_token():
    """urllib.request.Request raises ValueError("unknown url type: '<the whole URL>'") in send_once,
    outside its try: the caller gets an exception carrying the token."""
    error = webhook.send_once(HOOK, "/", b"{}", b"k" * 32, 1.0)
    assert error is not None and "s3cr3tT0ken" not in error


def test_a_bad_webhook_url_does_not_kill_the_sender_thread_or_print_the_token(caplog):
    """The ValueError escapes _deliver and ends the daemon thread (threading.excepthook prints the
    traceback, URL and token included, to the scheduler's log); every later event is queued to a
    thread that is gone: no alert is ever sent again and nothing says so."""
    hooked: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: hooked.append(str(args.exc_value))
    n = webhook.Notifier(HOOK, b"k" * 32, attempts=1, backoff=0.01)
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt.webhook"):
            n.post({"event": "fired", "alert": "disk_full"})
            deadline = time.monotonic() + 5
            while n.dropped + n.delivered < 1 and not hooked and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            assert n._thread is not None and n._thread.is_alive(), f"sender thread died: {hooked}"
            assert n.dropped == 1
        assert "s3cr3tT0ken" not in caplog.text + "".join(hooked)
    finally:
        n.close()
        threading.excepthook = previous


def test_an_endpoint_that_answers_garbage_is_a_failed_attempt_not_a_dead_thread():
    """http.client's BadStatusLine (an HTTPException, neither OSError nor ValueError) escapes
    send_once: an endpoint that is not HTTP (a TLS port reached over http://, a proxy's junk) kills
    the sender thread the same way."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve() -> None:
        for _ in range(4):
            try:
                conn, _addr = server.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"\x15\x03\x01\x00\x02\x02\x46garbage\r\n\r\n")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}/hook"
        assert webhook.send_once(url, "/hook", b"{}", b"k" * 32, 2.0) is not None
    finally:
        server.close()

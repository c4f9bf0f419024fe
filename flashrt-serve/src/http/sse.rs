//! Server-sent events: `data: ...` frames from the worker's [`Event`]s.

use super::*;

pub(super) type Formatter = Box<dyn FnMut(Event) -> Vec<String> + Send>;

/// `data: ...\n\n` frames from the worker's events; ends after the final event.
struct SseStream {
    rx: mpsc::UnboundedReceiver<Event>,
    fmt: Formatter,
    queue: VecDeque<Bytes>,
    done: bool,
}

impl futures_core::Stream for SseStream {
    type Item = Result<Bytes, Infallible>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(b)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => {
                    let last = matches!(ev, Event::Done(_) | Event::Error(_));
                    for s in (this.fmt)(ev) {
                        this.queue.push_back(Bytes::from(format!("data: {s}\n\n")));
                    }
                    this.done = last;
                }
                Poll::Ready(None) => this.done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

pub(super) fn sse(rx: mpsc::UnboundedReceiver<Event>, fmt: Formatter) -> Response {
    let stream = SseStream {
        rx,
        fmt,
        queue: VecDeque::new(),
        done: false,
    };
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

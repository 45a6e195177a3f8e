"""What the demo shows while it runs, and how it prints results.

On a terminal, ``rich`` draws a live view: one panel per prompt with the tail
of its text as it streams, and a status line with tokens/s and pages in use.
When stdout is not a terminal (a pipe, a file), stdout gets plain text only:
one block per prompt, in the order given, after the run::

    ### Prompt 1: <the prompt>
    <its generated text>

and the progress line (if stderr is a terminal) and the report go to stderr.
"""
import sys

#: Header of each prompt's block in plain (non-terminal) output.
BLOCK_HEADER = "### Prompt {number}: {prompt}"


class RunView:
    """Progress and results of one demo run.

    Parameters
    ----------
    prompts : list of str
        As the user gave them (titles of the blocks).
    out, err : text streams, default sys.stdout and sys.stderr
    """

    def __init__(self, prompts, *, out=None, err=None):
        from rich.console import Console
        self.prompts = list(prompts)
        self.texts = [""] * len(self.prompts)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.out_console = Console(file=self.out)
        self.err_console = Console(file=self.err)
        self.stream_text = self.out_console.is_terminal
        self.show_progress = self.stream_text or self.err_console.is_terminal
        self.status = "loading"
        self._live = None

    # -- live view --------------------------------------------------------------
    def __enter__(self):
        if self.show_progress:
            from rich.live import Live
            console = self.out_console if self.stream_text else self.err_console
            self._live = Live(get_renderable=self._render, console=console,
                              refresh_per_second=8, transient=True,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.stop()
            self._live = None

    def add_text(self, index, text):
        """Append newly generated ``text`` to prompt ``index``."""
        self.texts[index] += text

    def update_status(self, engine, num_not_added=0):
        """Refresh the status line from the engine's counters.

        The line reads, e.g.::

            step 12 | running 2, waiting 0, done 1, not yet added 1 | prefill 310 tok/s |
            decode 24.3 tok/s | pages in use 9/40 (peak 11)

        *running*: requests in the batch (holding KV pages); *waiting*:
        added but queued for a free slot or pages; *done*: finished;
        *not yet added*: prompts the demo adds later (``--stagger``).  The
        throughputs are :class:`~pagedkv.models.engine.EngineStats`'.

        Parameters
        ----------
        engine : Engine
        num_not_added : int
            Prompts not given to the engine yet.
        """
        s, cache = engine.stats, engine.cache
        in_use = cache.num_pages - cache.num_free_pages
        num_done = len(engine.requests) - engine.num_running - engine.num_waiting
        self.status = (f"step {s.num_steps} | running {engine.num_running}, waiting "
                       f"{engine.num_waiting}, done {num_done}, not yet added {num_not_added}"
                       f" | prefill {s.prefill_tokens_per_second:.0f} tok/s"
                       f" | decode {s.decode_tokens_per_second:.1f} tok/s | pages in use "
                       f"{in_use}/{cache.num_pages} (peak {s.peak_pages_in_use})")

    def _render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.text import Text
        status = Text(self.status, style="bold cyan")
        if not self.stream_text:
            return status
        console = self.out_console
        height, width = console.size.height, console.size.width
        lines_each = max(1, (height - 2) // max(1, len(self.prompts)) - 2)
        panels = []
        for number, (prompt, text) in enumerate(zip(self.prompts, self.texts), 1):
            wrapped = Text(text).wrap(console, max(10, width - 4))
            tail = Text("\n").join(list(wrapped)[-lines_each:])
            panels.append(Panel(tail, title=_title(number, prompt), title_align="left",
                                height=lines_each + 2))
        return Group(*panels, status)

    # -- results ---------------------------------------------------------------------
    def print_results(self, report_lines):
        """Print every prompt's full text, then the report."""
        if self.stream_text:
            from rich.panel import Panel
            from rich.text import Text
            for number, (prompt, text) in enumerate(zip(self.prompts, self.texts), 1):
                self.out_console.print(Panel(Text(text), title=_title(number, prompt),
                                             title_align="left"))
            self.out_console.print(Text("\n".join(report_lines), style="dim"))
            return
        for number, (prompt, text) in enumerate(zip(self.prompts, self.texts), 1):
            print(BLOCK_HEADER.format(number=number, prompt=prompt), file=self.out)
            print(text, file=self.out)
            print(file=self.out)
        self.out.flush()
        print("\n".join(report_lines), file=self.err)


def _title(number, prompt, limit=70):
    one_line = " ".join(prompt.split())
    if len(one_line) > limit:
        one_line = one_line[:limit - 1] + "…"
    from rich.markup import escape
    return f"[{number}] {escape(one_line)}"

"""MkDocs hooks for the documentation site.

- The committed benchmark results (``benchmarks/results/``) are published under
  ``results/``, and a page's links to ``../benchmarks/results/NAME`` (which work when
  the Markdown is read in the repository) become links to ``results/NAME``.
- reST roles left in docstrings (``:class:`X```) render as plain code (``X``).
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj):(<code>)~?")


def on_files(files, config):
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith((".txt", ".json", ".png")):
            files.append(
                File(
                    f"results/{name}",
                    src_dir=os.path.dirname(RESULTS),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace("](../benchmarks/results/", "](results/")


def on_page_content(html, page, config, files):
    return ROLE.sub(r"\1", html)

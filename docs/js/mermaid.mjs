// Draws the site's ```mermaid blocks, which pymdownx.superfences (mkdocs.yml) writes as
// <div class="mermaid">: mermaid replaces each with an SVG. Mermaid is loaded from the
// jsDelivr CDN at one pinned release, the form of loading mermaid's own docs give;
// tests/browser/test_docs_site.py serves that release from npm and checks the diagrams draw.
import mermaid from "https://cdn.jsdelivr.net/npm/mermaid@12.3.0/dist/mermaid.esm.min.mjs";

mermaid.initialize({ startOnLoad: false });
await mermaid.run({ querySelector: "div.mermaid" });

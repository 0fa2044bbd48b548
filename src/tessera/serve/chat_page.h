// The chat page `tessera serve` answers GET / with: one self-contained HTML document (inline CSS
// and JS, no external resources) that talks to the server's own /v1 and /stats endpoints.
#pragma once
#include <string>

namespace tessera::serve {

// The page, built once; served as "text/html; charset=utf-8".
const std::string& chat_page_html();

}  // namespace tessera::serve

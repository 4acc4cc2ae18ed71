// HttpGet: a plain HTTP/1.0 GET on loopback, for tests that read a
// server's Prometheus endpoint (/metrics) as a scraper would.
#ifndef ATTENTION_TESTS_SERVER_HTTP_GET_H_
#define ATTENTION_TESTS_SERVER_HTTP_GET_H_

#include <string>

namespace attention::testing {

// GETs `path` from 127.0.0.1:`port`; the whole response (status line,
// headers and body), or "" when nothing answers. Gives up on a response
// that takes longer than 20 s.
std::string HttpGet(int port, const std::string& path);

}  // namespace attention::testing

#endif  // ATTENTION_TESTS_SERVER_HTTP_GET_H_

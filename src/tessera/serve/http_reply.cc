// http_reply.h: JSON replies and the exception-to-error mapping the servers share.
#include "tessera/serve/http_reply.h"

#include "tessera/base/error.h"

namespace tessera::serve {

std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void send_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  if (e.status == 429 || e.status == 503) res.set_header("Retry-After", "1");
  send_json(res, e.status, error_body(e.what(), e.type, e.param, e.code));
}

ApiError api_error_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ApiError& a) {
    return a;
  } catch (const FieldError& f) {
    return ApiError(400, "invalid_request_error", f.field(), "", f.what());
  } catch (const Error& x) {
    return ApiError(400, "invalid_request_error", "", "", x.what());
  } catch (const std::exception& x) {
    return ApiError(500, "internal_error", "", "", std::string("internal error: ") + x.what());
  } catch (...) {
    return ApiError(500, "internal_error", "", "", "internal error");
  }
}

}  // namespace tessera::serve

// Checks that a call throws tessera::Error with a message holding every needle (and, when
// asked, on one line: the project's error contract).
#pragma once
#include <gtest/gtest.h>

#include <exception>
#include <initializer_list>
#include <string>

#include "tessera/base/error.h"

namespace tessera::testing {

template <typename Fn>
::testing::AssertionResult throws_error(Fn&& fn, std::initializer_list<const char*> needles, bool one_line = false) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (one_line && msg.find('\n') != std::string::npos)
      return ::testing::AssertionFailure() << "message '" << msg << "' is not one line";
    for (const char* n : needles)
      if (msg.find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << msg << "' lacks '" << n << "'";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-tessera exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace tessera::testing

#include "common/address.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen {
namespace {

using ::testing::HasSubstr;

TEST(Address, HostPortForListening) {
  auto a = ParseHostPort("127.0.0.1:0", "HTTP listen");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 0);
  auto v6 = ParseHostPort("[::1]:8080", "HTTP listen");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 8080);
  for (const char* bad : {"", "8080", ":80", "host:", "host:x", "host:-1",
                          "host:65536"}) {
    auto r = ParseHostPort(bad, "HTTP listen");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("HTTP listen address"));
  }
}

TEST(Address, DialledHostPortNeedsARealPort) {
  auto a = ParseDialHostPort("node-0.kv:50051");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "node-0.kv");
  EXPECT_EQ(a->port, 50051);
  EXPECT_EQ(ParseDialHostPort("[fe80::1]:1")->host, "fe80::1");
  for (const char* bad : {"node:0", "node", ":1", "node:65536", "node:1x"}) {
    EXPECT_EQ(ParseDialHostPort(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(Address, UnixPath) {
  EXPECT_EQ(*ParseUnixPath("unix:/tmp/kv.sock"), "/tmp/kv.sock");
  EXPECT_THAT(std::string(ParseUnixPath("tcp://a:1").status().message()),
              HasSubstr("want unix:PATH"));
  EXPECT_THAT(std::string(ParseUnixPath("unix:").status().message()),
              HasSubstr("empty socket path"));
  EXPECT_THAT(
      std::string(ParseUnixPath("unix:/" + std::string(200, 'x'))
                      .status()
                      .message()),
      HasSubstr("longer than"));
}

TEST(Address, ListenAddress) {
  auto u = ParseListenAddress("unix:/tmp/w.sock");
  ASSERT_TRUE(u.ok());
  EXPECT_TRUE(u->is_unix());
  EXPECT_EQ(u->unix_path, "/tmp/w.sock");
  auto t = ParseListenAddress("0.0.0.0:0");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->is_unix());
  EXPECT_EQ(t->host_port.host, "0.0.0.0");
  EXPECT_THAT(std::string(ParseListenAddress("unix:").status().message()),
              HasSubstr("has no path"));
  EXPECT_THAT(
      std::string(ParseListenAddress("localhost").status().message()),
      HasSubstr("is not HOST:PORT or unix:PATH"));
}

}  // namespace
}  // namespace infinigen

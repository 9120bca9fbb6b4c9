// The conformance routes on Node's http module: node node_app.js PORT KEEPALIVE_MS
const http = require("http");
const [port, keepAliveMs] = process.argv.slice(2).map(Number);
const server = http.createServer((req, res) => {
  req.resume();
  req.on("end", () => {
    if (req.url === "/chunked") {
      res.writeHead(503);
      res.write("answered ");
      res.end("in chunks");
    } else if (req.url.startsWith("/status/")) {
      const status = Number(req.url.split("/")[2]);
      res.writeHead(status, { "content-type": "text/plain" });
      res.end(`answered ${status}`);
    } else if (req.url === "/close") {
      res.writeHead(204, { connection: "close" });
      res.end();
    } else {
      res.writeHead(204);
      res.end();
    }
  });
});
server.keepAliveTimeout = keepAliveMs;
server.listen(port, "127.0.0.1");

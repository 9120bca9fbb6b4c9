// Writes the records the tests describe with the Java client (kafka-clients), as a team's
// Java service would. tests/test_kafka_records.py compiles it with javac once (cached by
// its hash) against the classpath of tests/kafka/pom.xml and runs it:
//
//   java -cp <classes>:<classpath> RecordsProducer BOOTSTRAP TOPIC < records
//
// One record a line, tab-separated: compression codec, key, value, then any headers as
// name=value. A key or value is "null" or "x" followed by its bytes in hex ("x" alone:
// empty). Records go to partition 0 in line order; one producer per codec, each flushed
// before the next starts, so offsets follow the lines.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.Future;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeader;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public class RecordsProducer {
    static byte[] bytes(String token) {
        if (token.equals("null")) {
            return null;
        }
        return HexFormat.of().parseHex(token.substring(1));
    }

    static KafkaProducer<byte[], byte[]> producer(String bootstrap, String codec) {
        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, codec);
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        props.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        props.put(ProducerConfig.LINGER_MS_CONFIG, "50");  // several records in one batch
        return new KafkaProducer<>(props, new ByteArraySerializer(), new ByteArraySerializer());
    }

    // Every record acknowledged (a failed send throws here), then the producer closed.
    static void finish(KafkaProducer<byte[], byte[]> producer, List<Future<RecordMetadata>> sent)
            throws Exception {
        producer.flush();
        for (Future<RecordMetadata> future : sent) {
            future.get();
        }
        sent.clear();
        producer.close();
    }

    public static void main(String[] args) throws Exception {
        String bootstrap = args[0];
        String topic = args[1];
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String codec = null;
        KafkaProducer<byte[], byte[]> producer = null;
        List<Future<RecordMetadata>> sent = new ArrayList<>();
        int written = 0;
        for (String line = in.readLine(); line != null; line = in.readLine()) {
            if (line.isEmpty()) {
                continue;
            }
            String[] fields = line.split("\t", -1);
            if (!fields[0].equals(codec)) {
                if (producer != null) {
                    finish(producer, sent);
                }
                codec = fields[0];
                producer = producer(bootstrap, codec);
            }
            List<org.apache.kafka.common.header.Header> headers = new ArrayList<>();
            for (int i = 3; i < fields.length; i++) {
                int eq = fields[i].indexOf('=');
                headers.add(new RecordHeader(fields[i].substring(0, eq), bytes(fields[i].substring(eq + 1))));
            }
            sent.add(producer.send(new ProducerRecord<>(topic, 0, bytes(fields[1]), bytes(fields[2]), headers)));
            written++;
        }
        if (producer != null) {
            finish(producer, sent);
        }
        System.out.println("written " + written);
    }
}

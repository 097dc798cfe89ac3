//! An operator's round through the console in headless Chromium (the system's
//! `chromium` and `chromedriver`; `.ci/run` installs them), driven over WebDriver.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

use crate::support::sink::{Reply, Sink};
use crate::support::{ADMIN_TOKEN, TestApp, eventually};

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";

/// A chromedriver on a free port. It leads its own process group, so the browsers it
/// starts go with it on drop even when a session could not be shut down cleanly.
struct Driver {
    child: Child,
    port: u16,
}

impl Driver {
    async fn start() -> Driver {
        assert!(
            std::path::Path::new(CHROMEDRIVER).exists(),
            "{CHROMEDRIVER} is missing: apt-get install -y chromium chromium-driver (.ci/run does)"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start chromedriver");
        let driver = Driver { child, port };
        eventually(Duration::from_secs(20), "chromedriver listens", || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok().map(|_| ())
        })
        .await;
        driver
    }

    /// A new headless browser session.
    async fn browser(&self) -> Client {
        self.browser_with(&[]).await
    }

    /// A new headless browser session with extra Chromium flags.
    async fn browser_with(&self, extra: &[&str]) -> Client {
        self.session(extra, None).await
    }

    /// A new headless session that emulates a phone's screen (390 × 844 CSS pixels: a
    /// desktop window cannot be made narrower than 500).
    async fn phone(&self) -> Client {
        self.session(&[], Some(json!({"deviceMetrics": {"width": 390, "height": 844, "pixelRatio": 3.0}}))).await
    }

    async fn session(&self, extra: &[&str], mobile: Option<serde_json::Value>) -> Client {
        let mut args = vec![
            // As root Chromium needs --no-sandbox; /dev/shm is small in containers.
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1440,1000",
            "--lang=en-US",
        ];
        args.extend_from_slice(extra);
        let mut caps = serde_json::Map::new();
        let mut options = json!({"binary": CHROMIUM, "args": args});
        if let Some(mobile) = mobile {
            options["mobileEmulation"] = mobile;
        }
        caps.insert("goog:chromeOptions".into(), options);
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a browser session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The whole group: chromedriver and every Chromium process it started.
        unsafe { libc::killpg(self.child.id() as libc::pid_t, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// End a browser session. The console has been checked by then; on a loaded machine
/// chromedriver can fail to shut Chromium down in time (a CI run failed here after every
/// assertion had passed), so a failed shutdown is reported, not a test failure: the
/// driver's drop kills what is left.
async fn close(browser: Client) {
    if let Err(e) = browser.close().await {
        eprintln!("closing the browser session failed ({e}); the driver's drop kills it");
    }
}

/// Where the screenshots go: `target/console-screenshots/`.
fn screenshot_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    dir
}

async fn screenshot(browser: &Client, name: &str) {
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::write(screenshot_dir().join(format!("{name}.png")), png).expect("write screenshot");
}

async fn text(browser: &Client, css: &str) -> String {
    browser.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("{css}: {e}")).text().await.expect("text")
}

async fn click(browser: &Client, css: &str) {
    browser.find(Locator::Css(css)).await.unwrap_or_else(|e| panic!("{css}: {e}")).click().await.expect("click");
}

/// Click something that navigates, and wait for an element of the page it leads to (a
/// click returns when the event is dispatched, not when the next page has loaded).
/// Click `css`, which leads to another page, and wait for that page to show `then`. The
/// page clicked on is marked first, so an element `then` that it also has (the search
/// form's results, say) is not mistaken for the next page's.
async fn click_to(browser: &Client, css: &str, then: &str) {
    browser.execute("document.documentElement.setAttribute('data-left', '')", vec![]).await.expect("mark the page");
    click(browser, css).await;
    let arrived = "return !document.documentElement.hasAttribute('data-left') \
                   && document.querySelector(arguments[0]) !== null";
    eventually(Duration::from_secs(20), &format!("after clicking {css}, a new page with {then}"), || async {
        (browser.execute(arrived, vec![json!(then)]).await.ok()? == json!(true)).then_some(())
    })
    .await;
}

async fn path(browser: &Client) -> String {
    browser.current_url().await.expect("url").path().to_owned()
}

#[tokio::test]
async fn an_operator_works_through_the_console_in_a_real_browser() {
    let app = TestApp::spawn().await;
    app.source_none("shop").await;
    // A verified source with a secret, and one forged webhook it refused.
    let github = json!({"name": "github-console", "kind": "github", "secrets": ["console-test-secret"]});
    app.admin_post("/v1/sources", github, 201).await;
    let forged = app.http.post(app.url("/ingest/github-console")).body("{}").send().await.unwrap();
    assert_eq!(forged.status(), 401);
    // Endpoint A refuses each delivery's first request with a 400 (dead at once) and takes
    // the next; endpoint B takes everything.
    let sink_a = Sink::start(|_, n| if n == 0 { Reply::status(400) } else { Reply::status(200) }).await;
    let sink_b = Sink::ok().await;
    let a = app.endpoint_for(&sink_a.url("/a"), Some("shop")).await;
    let b = app.admin_post("/v1/endpoints", json!({"url": sink_b.url("/b"), "description": "billing"}), 201).await;
    let b = b["id"].as_str().unwrap().to_owned();
    for i in 1..=3 {
        let body = json!({"order": i, "note": "<script>alert(1)</script>"}).to_string();
        let (status, _) = app.ingest("shop", &format!("order-{i}"), "order.created", &body).await;
        assert_eq!(status, 200);
    }
    let dead_path = format!("/v1/deliveries?endpoint_id={a}&status=dead");
    eventually(Duration::from_secs(20), "three dead letters", || async {
        (app.admin_get(&dead_path).await["data"].as_array().unwrap().len() == 3).then_some(())
    })
    .await;

    let driver = Driver::start().await;
    let browser = driver.browser().await;

    // Not signed in: any page leads to the sign-in form.
    browser.goto(&app.url("/console")).await.unwrap();
    assert_eq!(path(&browser).await, "/console/login");
    let icon = "return document.querySelector('link[rel=icon]').href";
    assert!(browser.execute(icon, vec![]).await.unwrap().as_str().unwrap_or_default().ends_with("/favicon.svg"));
    screenshot(&browser, "login").await;
    browser.find(Locator::Css("#token")).await.unwrap().send_keys(ADMIN_TOKEN).await.unwrap();
    click_to(&browser, "#sign-in", "#dead-hour").await;
    assert_eq!(path(&browser).await, "/console");
    assert!(text(&browser, "#dead-hour").await.contains('3'), "three died in the last hour");
    screenshot(&browser, "overview").await;
    // The numbers refresh by themselves: the script swaps in a fresh fragment (allowed by
    // the CSP, with no inline script), so a mark on the old one disappears.
    browser.execute("document.querySelector('#live .cards').setAttribute('data-old', '1')", vec![]).await.unwrap();
    eventually(Duration::from_secs(30), "the overview refreshes itself", || async {
        let old =
            browser.execute("return document.querySelector('#live .cards[data-old]') !== null", vec![]).await.ok()?;
        (old == json!(false) && browser.find(Locator::Css("#live .cards")).await.is_ok()).then_some(())
    })
    .await;

    // Find the event by what it holds: a value in its payload, in any source.
    browser.goto(&app.url("/console/events")).await.unwrap();
    browser.find(Locator::Css("#f-payload")).await.unwrap().send_keys("order = 2").await.unwrap();
    click_to(&browser, "#f-search", "#events").await;
    let rows = browser.find_all(Locator::Css("#events tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 1, "one event holds order 2");
    assert!(text(&browser, "#events").await.contains("order-2"));
    // Typed wrong: the reason on the same page, with what was typed still there.
    browser.goto(&app.url("/console/events")).await.unwrap();
    browser.find(Locator::Css("#f-payload")).await.unwrap().send_keys("order 2").await.unwrap();
    click_to(&browser, "#f-search", "#problem").await;
    assert!(text(&browser, "#problem").await.contains("PATH=VALUE"));
    let typed = browser.find(Locator::Css("#f-payload")).await.unwrap().prop("value").await.unwrap();
    assert_eq!(typed.as_deref(), Some("order 2"));

    // Find the event by source and dedupe key.
    browser.goto(&app.url("/console/events")).await.unwrap();
    browser.find(Locator::Css("#f-source")).await.unwrap().select_by_value("shop").await.unwrap();
    browser.find(Locator::Css("#f-key")).await.unwrap().send_keys("order-2").await.unwrap();
    click_to(&browser, "#f-search", "#events").await;
    let rows = browser.find_all(Locator::Css("#events tbody tr")).await.unwrap();
    assert_eq!(rows.len(), 1, "one event has that key");
    screenshot(&browser, "events").await;
    click_to(&browser, "#events tbody tr a", "#payload").await;
    assert!(path(&browser).await.starts_with("/console/events/"));
    let payload = text(&browser, "#payload").await;
    assert!(payload.contains("\"order\": 2") && payload.contains("<script>alert(1)</script>"), "{payload}");
    // The script ran (CSP allows the served file): times are local, UTC on hover.
    let time = browser.find(Locator::Css("time.local")).await.expect("times localised by the script");
    assert!(time.attr("title").await.unwrap().unwrap_or_default().ends_with("UTC"));
    screenshot(&browser, "event").await;

    // Its failed delivery: the timeline, then redeliver.
    click_to(&browser, "#deliveries tbody tr a", "#attempts").await;
    assert_eq!(text(&browser, "#status").await, "dead");
    assert!(text(&browser, "#attempts").await.contains("HTTP 400"));
    screenshot(&browser, "delivery-dead").await;
    // The sink has seen order 2 once (the 400); the redelivery is its second request.
    let order_2 = || {
        let is_order_2 = |body: &[u8]| serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["order"] == 2);
        sink_a.received().iter().filter(|r| is_order_2(&r.body)).count()
    };
    assert_eq!(order_2(), 1);
    click_to(&browser, "#redeliver", "#notice").await;
    assert!(text(&browser, "#notice").await.contains("Redelivery queued"));
    let query = browser.current_url().await.expect("url").query().map(str::to_owned).unwrap_or_default();
    assert!(!query.contains("done="), "the notice left the address bar: a reload does not repeat it ({query})");
    eventually(Duration::from_secs(20), "the sink receives the redelivery", || async {
        (order_2() == 2).then_some(())
    })
    .await;
    eventually(Duration::from_secs(20), "the page shows it delivered", || async {
        browser.refresh().await.ok()?;
        (text(&browser, "#status").await == "delivered").then_some(())
    })
    .await;
    screenshot(&browser, "delivery").await;
    // Delivered now: resending it asks first, and Cancel sends nothing.
    click(&browser, "#redeliver").await;
    let asked = browser.get_alert_text().await.expect("a confirmation");
    assert!(asked.contains("was delivered"), "{asked}");
    browser.dismiss_alert().await.expect("cancel");
    assert_eq!(text(&browser, "#status").await, "delivered");
    assert!(browser.find(Locator::Css("#notice")).await.is_err(), "nothing queued");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(order_2(), 2, "cancelled: not sent again");

    // Pause endpoint B from its page.
    browser.goto(&app.url("/console/endpoints")).await.unwrap();
    screenshot(&browser, "endpoints").await;
    browser.goto(&app.url(&format!("/console/endpoints/{b}"))).await.unwrap();
    click_to(&browser, "#pause", "#notice").await;
    assert_eq!(text(&browser, "#state").await, "paused");
    assert_eq!(app.admin_get(&format!("/v1/endpoints/{b}")).await["paused"], true);
    screenshot(&browser, "endpoint").await;
    // Rotating its secret asks first: Cancel stays on the page, OK rotates it.
    click(&browser, "#rotate").await;
    assert!(browser.get_alert_text().await.expect("a confirmation").contains("Rotate"));
    browser.dismiss_alert().await.expect("cancel");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(text(&browser, "#state").await, "paused", "cancelled: still the endpoint's page");
    assert!(browser.find(Locator::Css("#new-secret")).await.is_err(), "cancelled: nothing rotated");
    click(&browser, "#rotate").await;
    browser.accept_alert().await.expect("confirm");
    eventually(Duration::from_secs(20), "the new secret is shown", || async {
        browser.find(Locator::Css("#new-secret")).await.ok().map(|_| ())
    })
    .await;

    // Recover A's window of dead letters: the confirmation says how many first.
    browser.goto(&app.url(&format!("/console/dead?endpoint={a}"))).await.unwrap();
    assert_eq!(browser.find_all(Locator::Css("#dead tbody tr")).await.unwrap().len(), 2);
    // Each says what it is (its event's type, source and key), and can be redelivered
    // from here, after a confirmation (cancelled here: the recovery below takes both).
    let first = text(&browser, "#dead tbody tr").await;
    assert!(first.contains("order.") && first.contains("shop"), "{first}");
    click(&browser, "#dead tbody tr button[name=one]").await;
    assert!(browser.get_alert_text().await.expect("a confirmation").contains("Redeliver"));
    browser.dismiss_alert().await.expect("cancel");
    assert_eq!(browser.find_all(Locator::Css("#dead tbody tr")).await.unwrap().len(), 2, "cancelled");
    screenshot(&browser, "dead-letters").await;
    // Its times are in the viewer's time zone, as the lists are, with the offset.
    let since = browser.find(Locator::Css("#r-since")).await.unwrap().prop("value").await.unwrap().unwrap_or_default();
    assert!(chrono::DateTime::parse_from_rfc3339(&since).is_ok(), "a local time with its offset: {since}");
    let label = browser.execute("return document.querySelector('#r-since').closest('label').textContent", vec![]);
    assert!(label.await.unwrap().as_str().unwrap_or_default().contains("your time zone"));
    click_to(&browser, "#r-review", "#recover-count").await;
    assert_eq!(text(&browser, "#recover-count").await, "2");
    screenshot(&browser, "recover-confirm").await;
    assert_eq!(app.admin_get(&dead_path).await["data"].as_array().unwrap().len(), 2, "nothing done before confirming");
    click_to(&browser, "#recover", "#requeued").await;
    assert_eq!(text(&browser, "#requeued").await, "2");
    eventually(Duration::from_secs(20), "the sink receives the recovered two", || async {
        (sink_a.received().iter().filter(|r| r.replied == 200).count() == 3).then_some(())
    })
    .await;

    browser.goto(&app.url("/console/sources")).await.unwrap();
    let sources = text(&browser, "#sources").await;
    assert!(sources.contains("/ingest/shop") && sources.contains("/ingest/github-console"), "{sources}");
    let fingerprint = webhook_gateway::verify::secret_fingerprint("console-test-secret");
    assert!(sources.contains(&fingerprint) && !sources.contains("console-test-secret\n"), "{sources}");
    assert!(sources.contains("1 missing_signature"), "the refusal is counted: {sources}");
    screenshot(&browser, "sources").await;

    // Sign out: the session is gone from this browser.
    click_to(&browser, "#sign-out", "#sign-in").await;
    assert_eq!(path(&browser).await, "/console/login");
    // A deep link survives signing in.
    browser.goto(&app.url(&format!("/console/dead?endpoint={a}"))).await.unwrap();
    assert_eq!(path(&browser).await, "/console/login");
    browser.find(Locator::Css("#token")).await.unwrap().send_keys(ADMIN_TOKEN).await.unwrap();
    click_to(&browser, "#sign-in", "#sign-out").await;
    let url = browser.current_url().await.expect("url");
    assert_eq!((url.path(), url.query()), ("/console/dead", Some(format!("endpoint={a}").as_str())));
    // An unknown console URL: the console's own 404 page.
    browser.goto(&app.url("/console/no-such-page")).await.unwrap();
    assert!(text(&browser, "#error-message").await.contains("no console page"));
    close(browser).await;

    // At a phone's width every page fits the screen: nothing scrolls the page sideways
    // (wide tables scroll inside themselves).
    let phone = driver.phone().await;
    phone.goto(&app.url("/console/login")).await.unwrap();
    phone.find(Locator::Css("#token")).await.unwrap().send_keys(ADMIN_TOKEN).await.unwrap();
    click_to(&phone, "#sign-in", "#dead-hour").await;
    let width = phone.execute("return window.innerWidth", vec![]).await.unwrap();
    assert!(width.as_i64().is_some_and(|w| w <= 420), "a phone's width: {width}");
    let delivery = app.admin_get(&format!("/v1/deliveries?endpoint_id={a}&limit=1")).await["data"][0]["id"].clone();
    let delivery = delivery.as_str().expect("a delivery of A").to_owned();
    for page in [
        "/console".to_owned(),
        "/console/events".to_owned(),
        "/console/dead?window=all".to_owned(),
        "/console/endpoints".to_owned(),
        format!("/console/endpoints/{a}"),
        format!("/console/deliveries/{delivery}"),
        "/console/sources".to_owned(),
        "/console/filters".to_owned(),
        "/console/transforms".to_owned(),
    ] {
        phone.goto(&app.url(&page)).await.unwrap();
        let fits = "return document.documentElement.scrollWidth <= window.innerWidth";
        assert_eq!(phone.execute(fits, vec![]).await.unwrap(), json!(true), "{page} is wider than a phone");
    }
    phone.goto(&app.url("/console")).await.unwrap();
    screenshot(&phone, "overview-phone").await;
    close(phone).await;

    // The same console in the dark (prefers-color-scheme: dark).
    let dark = driver.browser_with(&["--force-dark-mode", "--blink-settings=preferredColorScheme=0"]).await;
    dark.goto(&app.url("/console/login")).await.unwrap();
    dark.find(Locator::Css("#token")).await.unwrap().send_keys(ADMIN_TOKEN).await.unwrap();
    click_to(&dark, "#sign-in", "#dead-hour").await;
    let scheme = dark.execute("return matchMedia('(prefers-color-scheme: dark)').matches", vec![]).await.unwrap();
    assert_eq!(scheme, json!(true), "the browser prefers dark");
    screenshot(&dark, "overview-dark").await;
    dark.goto(&app.url(&format!("/console/endpoints/{b}"))).await.unwrap();
    screenshot(&dark, "endpoint-dark").await;
    close(dark).await;
}
